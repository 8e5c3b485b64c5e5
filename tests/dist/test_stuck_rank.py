"""One of 3 gloo ranks SIGSTOPped or SIGKILLed at a seeded step and point of the
step; every survivor's backward() raises within the timeout, with commpress's own message.

Set-up runs at a long process-group timeout; the short bound applies from the fault window on
(tests/dist/stuck_ranks.py). The default run covers each kind of wait once (a single-round
collective DDP waits on, intermediate rounds in the hook's thread, auto's tuning; a kill);
``-m stuck_matrix`` runs every algorithm and every auto phase, stopped and killed
(``bench/stuck_rank.py`` prints the same matrix as a table)."""

import pytest

from dist.stuck_ranks import CASES, FAST_RUNS, run_one

pytestmark = [pytest.mark.dist]

PG_TIMEOUT = 3.0
SLACK = 8.0  # the watchdog's poll, the last bucket's issue, a loaded 2-core machine
SETUP = 150.0  # spawn, imports, DDP, the first steps: not measured


def _check(case, how, out):
    assert out["setup"] is None, f"{case} {how}: set-up did not finish (not the fault): {out['setup']}"
    assert out["stopped"] is not None, f"{case}: the victim never reached its fault point: {out}"
    for r, o in out["survivors"].items():
        assert o is not None, f"{case} {how}: rank {r} did not raise within {PG_TIMEOUT + SLACK} s (hang)"
        assert "error" not in o, o.get("error")
        assert o["t"] is not None, f"{case} {how}: rank {r} trained to the end without an error"
        assert o["armed"] and o["seconds"] >= 0, f"{case} {how}: rank {r} raised before the fault: {o}"
        assert o["seconds"] <= PG_TIMEOUT + SLACK, (case, how, r, o)
        msg = o["msg"]
        assert msg.startswith("commpress: "), msg
        assert msg.count("commpress:") == 1, msg
        assert "Unable to cast" not in msg and "Got the following error" not in msg, msg
        assert "\n" not in msg, msg  # no traceback tail from torch's callback wrapping
        assert f"rank {r} of {case.world}" in msg and "step " in msg and "bucket" in msg, msg
        assert "restart" in msg, msg  # says what to do
        # a peer's failure, never a decode of what a broken collective handed back
        assert "did not complete within" in msg or "rank count" in msg or "corrupt" in msg \
            or "peer" in msg, msg
        assert o["type"] in ("RuntimeError", "CollectiveTimeout"), o


@pytest.mark.timeout(SETUP + 60)
@pytest.mark.parametrize("case,how", FAST_RUNS, ids=lambda v: repr(v) if not isinstance(v, str) else v)
def test_every_survivor_raises(case, how):
    _check(case, how, run_one(case, how, pg_timeout=PG_TIMEOUT, slack=SLACK, setup_timeout=SETUP, seed=0))


@pytest.mark.stuck_matrix
@pytest.mark.timeout(SETUP + 60)
@pytest.mark.parametrize("how", ["stop", "kill"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_every_survivor_raises_matrix(case, how):
    _check(case, how, run_one(case, how, pg_timeout=PG_TIMEOUT, slack=SLACK, setup_timeout=SETUP, seed=1))
