"""Adam(W) in momentum space: register(..., optimizer=adamw) with a biased compressor keeps
Adam's quality (the gradient path does not), replicas stay bitwise equal, and a checkpoint
taken before or after the variance froze resumes bit-exactly."""

import pytest
import torch

from comms.cluster.launch import spawn
from dist import adam_ranks as A

pytestmark = [pytest.mark.dist]

STEPS = 150


@pytest.mark.timeout(400)
def test_topk_under_adamw_keeps_dense_quality_where_the_gradient_path_does_not():
    # measured (teacher task, AdamW, 150 steps, 2 ranks): momentum space 1.066x dense's final
    # loss, the gradient path 1.149x
    dense = spawn(A.quality, 2, None, STEPS, {}, timeout=120)[0]["final"]
    ours = spawn(A.quality, 2, "topk:density=0.01", STEPS, {}, timeout=120)
    grad = spawn(A.quality, 2, "topk:density=0.01", STEPS, {"adam_freeze": None}, timeout=120)
    assert ours[0]["adam"]["frozen"] and 10 <= ours[0]["adam"]["freeze_iter"] < STEPS
    assert ours[0]["final"] / dense <= 1.08, (ours[0]["final"], dense)
    assert grad[0]["final"] / dense > 1.10, (grad[0]["final"], dense)  # what momentum space fixes
    for r in ours:
        assert torch.equal(r["params"], ours[0]["params"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", ["sign", "topk:density=0.05"])
@pytest.mark.parametrize("save_at", [24, 36])  # before and after the variance froze (step 30)
def test_resume_across_the_variance_freeze_is_bitwise(tmp_path, spec, save_at):
    res = spawn(A.resume, 2, spec, str(tmp_path), 30, save_at, 44, timeout=240)
    for r in res:
        assert r["frozen_at"] == 30
        assert r["straight"].isfinite().all()
        assert torch.equal(r["straight"], r["resumed"])
    assert torch.equal(res[0]["straight"], res[1]["straight"])


@pytest.mark.longrun
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("spec,algorithm", [("sign", "allgather"), ("topk:density=0.01", "two_phase")])
def test_replicas_bitwise_over_500_steps_at_3_ranks(spec, algorithm):
    res = spawn(A.quality, 3, spec, 500, {"algorithm": algorithm}, timeout=1100)
    assert res[0]["adam"]["frozen"]
    for r in res:
        assert torch.equal(r["params"], res[0]["params"])
