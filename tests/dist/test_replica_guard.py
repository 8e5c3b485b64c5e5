"""``register(..., check_replicas_every=N)``: silent while replicas agree, raises on every rank
at the first check after they differ, naming the parameter; bad values rejected up front."""

import pytest
import torch

import comms
from comms.cluster.launch import spawn
from dist import replica_ranks

pytestmark = [pytest.mark.dist]


@pytest.mark.timeout(120)
def test_guard_counts_checks_when_replicas_agree():
    out = spawn(replica_ranks.guard_case, 2, 10, 3, None, timeout=100)
    assert out == [("ok", 3), ("ok", 3)]  # steps 3, 6, 9


@pytest.mark.timeout(120)
def test_guard_raises_on_every_rank_naming_the_parameter():
    out = spawn(replica_ranks.guard_case, 3, 12, 4, 5, timeout=100)
    for rank, res in enumerate(out):
        assert res[0] == "raised", (rank, res)
        assert res[1] == 8, (rank, res)  # perturbed before step 5, caught at the step-8 check
        assert "up.weight" in res[3] and "step 8" in res[3] and "rank(s) [1]" in res[3], res[3]


class _FakeDDP(torch.nn.parallel.DistributedDataParallel):
    def __init__(self):  # no process group needed: register() must refuse before using it
        torch.nn.Module.__init__(self)
        self.module = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (2.5, TypeError), (True, TypeError),
                                      ("3", TypeError)])
def test_bad_check_replicas_every(bad, exc):
    with pytest.raises(exc, match="check_replicas_every"):
        comms.register(_FakeDDP(), "fp16", check_replicas_every=bad)
