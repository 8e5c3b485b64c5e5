"""Communicating every H steps (``register(..., sync_every=H)``): the synced parameters are
bitwise equal on every rank at every sync, a checkpoint taken mid-period (a fragment in
flight) resumes bitwise, and bad options raise before anything changes."""

import pytest
import torch

from comms.cluster.launch import spawn
from dist import outer_ranks as R

pytestmark = [pytest.mark.dist]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec,kw", [
    ("qsgd:bits=4", dict(sync_every=4)),
    ("sign", dict(sync_every=8, sync_fragments=2, sync_delay=3)),
    ("topk:density=0.05", dict(sync_every=6, sync_fragments=3, sync_delay=1, outer="sparseloco")),
], ids=["qsgd4-H4", "sign-H8-P2-tau3", "topk-sparseloco"])
def test_synced_parameters_bitwise_at_every_sync_over_500_steps(spec, kw):
    res = spawn(R.synced_at_every_sync, 2, spec, 500, kw, timeout=240)
    a, b = res
    assert a["seen"] == b["seen"]  # the anchors, after every step, the same bits on both ranks
    assert min(a["syncs"]) >= 500 // kw["sync_every"] - 1
    assert not torch.equal(a["local"], b["local"]) or kw.get("sync_delay", 0) == 0
    assert a["reducer"] is False and b["reducer"] is False  # DDP's bucket copies off: nothing to reduce


@pytest.mark.timeout(300)
def test_resume_mid_period_is_bitwise(tmp_path):
    # H 8, 2 fragments, 3 steps overlapped: at step 13 fragment 1 (sent after step 12) is in
    # flight; outer momentum is part of what resumes
    kw = dict(sync_every=8, sync_fragments=2, sync_delay=3, outer="nesterov")
    for r in spawn(R.resume_mid_period, 2, "sign", str(tmp_path), 30, 13, kw, timeout=240):
        assert r["in_flight"] == [1]
        assert torch.equal(r["straight"], r["resumed"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec,kw", [
    ("qsgd:bits=4", dict(sync_every=4)),
    ("sign", dict(sync_every=4, sync_delay=1)),
], ids=["qsgd4-tau0", "sign-tau1"])
def test_a_nonfinite_pseudo_gradient_on_one_rank_is_skipped_on_every_rank(spec, kw):
    # the flag is found in the send's own pass (no error feedback: qsgd) or in the residual's
    # (sign): every rank skips the update and restarts from the last synced parameters
    res = spawn(R.nonfinite_pseudo_gradient, 2, spec, kw, timeout=200)
    for r in res:
        assert r["after"] == r["before"] == res[0]["before"]  # the synced values kept, bit for bit
        assert r["finite"] and r["finite_end"], r
        assert any("was not finite on some rank" in m for m in r["logged"]), r["logged"]
        assert r["syncs"] == [3]  # after steps 3, 7 and 11: the sync after the skip ran too


def test_bad_options_raise_before_anything_changes():
    e = spawn(R.bad_options, 1, timeout=120)[0]
    assert "sync_every must be an int >= 1" in e["every0"] and "-1" in e["every0"]
    assert "sync_delay must be < sync_every" in e["delay"]
    assert "sync_fragments must be <= sync_every" in e["fragments"]
    assert "outer must be one of" in e["outer"] and "'adam'" in e["outer"]
    assert "sparseloco" in e["sparseloco_qsgd"] and "error feedback" in e["sparseloco_qsgd"]
    assert "outer_lr" in e["lr"]
    assert "pass sync_every=H too" in e["no_every"]
    assert "clip_norm" in e["per_step"] and "stay local" in e["per_step"]
    assert "adam_freeze=10 does not apply with sync_every" in e["freeze"]
    assert "sync_every needs optimizer=opt" in e["no_optimizer"]
    assert all(v for k, v in e.items() if k.endswith(".untouched")), e


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_peer_lost_during_an_overlapped_sync_makes_every_survivor_raise(how):
    from dist.stuck_ranks import Case, run_one

    # H 8, tau 4: the survivors send after step 15, train 4 inner steps, land after step 19
    case = Case("outer sign H8 tau4", "sign", dict(sync_every=8, sync_delay=4), "overlapped sync",
                steps=30, at=(9, 15), world=3, body=R.outer_fault_body)
    out = run_one(case, how, pg_timeout=4.0, slack=12.0, setup_timeout=150.0)
    assert out["setup"] is None, out["setup"]
    for r, o in out["survivors"].items():
        assert o is not None and o.get("t") is not None and "error" not in o, (r, o)
        assert 0 <= o["seconds"] <= 4.0 + 12.0 + 5.0, o  # the timeout from the send, 4 quick inner steps
        msg = o["msg"]
        assert msg.startswith("commpress: ") and "outer sync" in msg and "fragment 0" in msg, msg
        assert f"rank {r} of 3" in msg and ("rank 2 is" in msg or "[2]" in msg), msg
        assert o["step"] == 19 and o["completed"] == 18, o  # it raised landing the fragment


@pytest.mark.longrun
@pytest.mark.timeout(900)
def test_hsdp_synced_shards_bitwise_at_every_sync_over_500_steps():
    res = spawn(R.hsdp_synced_at_every_sync, 4, "qsgd:bits=4", 500,
                dict(sync_every=8, sync_fragments=2, sync_delay=2), timeout=840)
    by_shard = {}
    for r in res:
        by_shard.setdefault(r["shard"], []).append(r)
    for a, b in by_shard.values():  # the two replicas of each shard
        assert a["seen"] == b["seen"] and min(a["syncs"]) >= 500 // 8 - 1


@pytest.mark.timeout(300)
def test_auto_switches_to_the_outer_sync_at_a_step_boundary():
    res = spawn(R.auto_switch, 2, 60, timeout=240)
    for rank, r in enumerate(res):
        assert r["taken"] == 0.0 and r["momentum"] == 0.9  # SGD's momentum back with the optimizer
        assert r["switched"] and min(r["syncs"]) >= 5, r
        assert r["reducer"] is False  # turned off at the switch
        # one WARNING line for the run: rank 0 says it, the others switch silently
        assert len(r["lines"]) == (rank == 0) and all("forced by the test" in m for m in r["lines"]), r
    assert res[0]["anchors"] == res[1]["anchors"]


@pytest.mark.timeout(300)
def test_auto_switches_when_a_round_ends_with_a_leader():
    # the tuning ends at the switch: the leader is locked with the reason, and said once
    res = spawn(R.auto_switch, 2, 60, True, timeout=240)
    for rank, r in enumerate(res):
        assert r["switched"] and r["locked"] and min(r["syncs"]) >= 5, r
        assert r["reason"].endswith("the outer sync takes over in round 2"), r["reason"]
        assert r["tuning_steps"] < 40 and r["reducer"] is False
        assert len(r["lines"]) == len(r["lock_lines"]) == (rank == 0), r
    assert res[0]["anchors"] == res[1]["anchors"] and res[0]["reason"] == res[1]["reason"]


def test_auto_switches_after_round_one_where_the_rules_step_within_three_quarters_of_dense():
    res = spawn(R.auto_switch, 2, 60, True, 1.5, timeout=240)
    for r in res:
        assert r["switched"] and r["locked"] and min(r["syncs"]) >= 5, r
        assert r["reason"].endswith("the outer sync takes over in round 1"), r["reason"]
    assert res[0]["anchors"] == res[1]["anchors"] and res[0]["tuning_steps"] == res[1]["tuning_steps"]
