"""A killed or stopped rank under FSDP2 (quantized parameter all-gathers, the overlapped
compressed reduce-scatter) and HSDP: every survivor raises commpress's error within the process
group's timeout — no ``timeout`` option set — naming the collective, module, step, its own rank
and the dead or stopped peer, and no survivor completes a step the dead peer did not send."""

import re

import pytest

from dist.fsdp_fault_ranks import fsdp_fault_body
from dist.stuck_ranks import Case, run_one

pytestmark = [pytest.mark.dist]

PG_TIMEOUT = 4.0
SLACK = 10.0  # naming the peer (<= 2.5 s), the watchdog's poll, a loaded 2-core machine
SETUP = 150.0


def _case(mode, params, point, world, spec="qsgd:bits=4"):
    kw = {"mode": mode, "warmup_steps": 0}
    if params is not None:
        kw["params"] = params
    return Case(f"{mode} {spec} params={params}", spec, kw, point, steps=14, at=(4, 8), world=world,
                body=fsdp_fault_body)


RUNS = [(_case("fsdp", "int8", "mid", 3), "kill"), (_case("fsdp", "int8", "between", 3), "kill"),
        (_case("fsdp", "int4", "mid", 3), "kill"), (_case("fsdp", "int4", "between", 3), "kill"),
        (_case("hsdp", None, "mid", 4), "kill"), (_case("hsdp", None, "mid", 4), "stop")]


@pytest.mark.timeout(SETUP + 90)
@pytest.mark.parametrize("case,how", RUNS, ids=lambda v: repr(v) if not isinstance(v, str) else v)
def test_every_survivor_raises_and_no_step_completes_after_the_fault(case, how):
    out = run_one(case, how, pg_timeout=PG_TIMEOUT, slack=SLACK, setup_timeout=SETUP, seed=0)
    assert out["setup"] is None, f"set-up did not finish (not the fault): {out['setup']}"
    stamp = out["stopped"]
    assert stamp is not None, out
    victim = case.world - 1
    for r, o in out["survivors"].items():
        assert o is not None, f"{case} {how}: rank {r} did not raise within {PG_TIMEOUT + SLACK} s (hang)"
        assert "error" not in o, o.get("error")
        assert o["t"] is not None, f"{case} {how}: rank {r} trained to the end on a dead peer's data"
        assert o["armed"] and 0 <= o["seconds"] <= PG_TIMEOUT + SLACK, (r, o)
        # no step after the fault completed: the victim died before sending step stamp["step"]
        assert o["completed"] < stamp["step"], (r, o["completed"], stamp)
        msg = o["msg"]
        assert msg.startswith("commpress: ") and msg.count("commpress:") == 1, msg
        assert "\n" not in msg and "Got the following error" not in msg, msg
        assert f"rank {r} of {case.world}" in msg and "step " in msg and "module " in msg, msg
        assert re.search(r"(FSDP|HSDP) .*(all-gather|reduce-scatter|all-reduce|allgather|allreduce|two_phase)", msg), msg
        word = "dead" if how == "kill" else "stopped"
        assert f"rank {victim} is {word}" in msg or f"[{victim}]" in msg, msg
        assert "restart" in msg, msg
