"""Issue 18: one of 3 gloo ranks SIGSTOPped or SIGKILLed at a seeded step and point of the
step; every survivor's backward() raises within the timeout, with commpress's own message.

The fast run covers the multi-round and the fixed-size gather algorithms and auto during
tuning; ``-m stuck_matrix`` runs every algorithm and every auto phase (``bench/stuck_rank.py`` prints
the same matrix as a table)."""

import pytest

from dist.stuck_ranks import CASES, FAST_CASES, run_one

pytestmark = [pytest.mark.dist]

PG_TIMEOUT = 5.0
SLACK = 8.0  # start-up of the victim's step, the last bucket's issue, a loaded 2-core machine


def _check(case, how, out):
    assert out["stopped"] is not None, f"{case}: the victim never reached its fault point: {out}"
    for r, o in out["survivors"].items():
        assert o is not None, f"{case} {how}: rank {r} did not raise within {PG_TIMEOUT + SLACK} s (hang)"
        assert "error" not in o, o.get("error")
        assert o["t"] is not None, f"{case} {how}: rank {r} trained to the end without an error"
        assert o["seconds"] <= PG_TIMEOUT + SLACK, (case, how, r, o)
        msg = o["msg"]
        assert msg.startswith("commpress: "), msg
        assert msg.count("commpress:") == 1, msg
        assert "Unable to cast" not in msg and "Got the following error" not in msg, msg
        assert "\n" not in msg, msg  # no traceback tail from torch's callback wrapping
        assert f"rank {r} of 3" in msg and "step " in msg and "bucket" in msg, msg
        assert "restart" in msg, msg  # says what to do
        assert o["type"] in ("RuntimeError", "CollectiveTimeout"), o


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["stop", "kill"])
@pytest.mark.parametrize("case", FAST_CASES, ids=repr)
def test_every_survivor_raises(case, how):
    _check(case, how, run_one(case, how, pg_timeout=PG_TIMEOUT, slack=SLACK, seed=0))


@pytest.mark.stuck_matrix
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["stop", "kill"])
@pytest.mark.parametrize("case", [c for c in CASES if c not in FAST_CASES], ids=repr)
def test_every_survivor_raises_matrix(case, how):
    _check(case, how, run_one(case, how, pg_timeout=PG_TIMEOUT, slack=SLACK, seed=1))
