"""The measured ``auto`` policy (comms.tuning.autotune): same plan on every rank, replicas bitwise
equal through the trial phase, the fastest plan wins (dense on ties), resume keeps the
locked plan, and a bucket that switches to dense drains its residuals over a few dense steps
(sum conservation, no burst).

Timings are injected with ``tuner.timing`` where the test needs a known winner; the plain
runs use real step times (whatever they are, every rank must lock the same rule)."""

import math
import os

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import comms
from comms.algorithms import get_algorithm
from comms.tuning.autotune import Autotuner, choose_rule
from comms.cluster.launch import spawn
from dist.ranks import batch, flat_params, make_model

pytestmark = [pytest.mark.dist]


def _ddp(spec, steps_per_trial=2, candidates=None, timing=None, start_iter=1, lr=0.05):
    torch.manual_seed(0)
    model = DDP(make_model(), bucket_cap_mb=0.01)
    state = comms.register(model, spec, start_iter=start_iter, autotune_steps=steps_per_trial)
    assert state.algorithm == "auto" and state.planner.tuner is not None  # the defaults
    state.planner.min_numel = 100  # the tiny model's weight buckets are worth planning
    if candidates is not None:
        state.planner.tuner.candidates = list(candidates)
    if timing is not None:
        state.planner.tuner.timing = timing
        state.planner.tuner.screen = 0.0  # fake step times are not the cost model's seconds: no screen
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9 if lr else 0.0)
    return model, state, opt


def _step(rank, model, opt, step):
    x, y = batch(rank, step)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


# -- real timings: agreement and replica identity ---------------------------------------------
def _real(rank, world, spec):
    model, state, opt = _ddp(spec, steps_per_trial=2)
    digests, rules, used = [], [], []
    for step in range(44):  # tuning takes at most 40 steps (interleaved rounds)
        before = {b: s.calls for b, s in state.stats.items()}
        _step(rank, model, opt, step)
        digests.append(flat_params(model.module))
        rules.append(state.planner.tuner.rule)
        used.append(sorted({s.algorithm for b, s in state.stats.items() if s.calls != before.get(b, 0)}))
    comms.check_replicas(model)
    tuner = state.planner.tuner
    flat = state.planner.model.tiers["flat"]
    return {"digests": digests, "rules": rules, "used": used, "locked": tuner.locked,
            "trials": tuner.trials, "table": tuner.table, "plan": str(state.plan),
            "betas": sorted(flat.betas), "mem": state.planner.model.mem_per_element}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_auto_tunes_to_one_plan_and_replicas_stay_equal(world):
    out = spawn(_real, world, "fp16", timeout=120)
    o0 = out[0]
    assert o0["locked"], o0["plan"]
    assert len(o0["trials"]) >= 2 and o0["trials"][0] == "dense"  # dense + >= 1 compressed plan
    # compressed trials really ran compressed algorithms (steps 3..: the second trial)
    assert any(set(u) - {"dense"} for u in o0["used"]), o0["used"]  # dense buckets are in stats too
    for r in range(1, world):
        assert out[r]["rules"] == o0["rules"], "ranks ran different plans"
        assert out[r]["table"] == o0["table"], "ranks agreed on different timings"
        for step, (a, b) in enumerate(zip(o0["digests"], out[r]["digests"])):
            assert torch.equal(a, b), f"rank {r} differs from rank 0 after step {step}"
    assert all(math.isfinite(s) for _, s, _ in o0["table"]), o0["table"]
    # the model was refined at the buckets' sizes with the fp16 wire's own bandwidth
    assert ("allreduce", "torch.float16") in o0["betas"] and o0["mem"] > 0
    assert "locked" in o0["plan"] and "predicted ms" in o0["plan"]


# -- injected timings: fastest wins, dense on near-ties, agreement by MAX ------------------------
FAKE = {
    "fast": {"dense": 1.0, "allgather": 0.5, "two_phase": 0.8},
    "near_tie": {"dense": 1.0, "allgather": 0.98, "two_phase": 0.99},
}


def _injected(rank, world, case):
    if case == "rank_disagrees":  # rank 0 sees allgather fast, rank 1 slow: the MAX rules
        fake = {"dense": 1.0, "allgather": 0.5 if rank == 0 else 1.5, "two_phase": 1.2}
    else:
        fake = FAKE[case]
    model, state, opt = _ddp("topk:density=0.1", steps_per_trial=2,
                             candidates=["allgather", "two_phase"], timing=lambda rule, s: fake[rule])
    for step in range(27):  # start 1, interleaved rounds of 2 steps per rule, >= 4 rounds
        _step(rank, model, opt, step)
    before = {b: s.calls for b, s in state.stats.items()}
    dense_before = state.dense_calls
    _step(rank, model, opt, 27)
    used = sorted({s.algorithm for b, s in state.stats.items() if s.calls != before.get(b, 0)})
    comms.check_replicas(model)
    t = state.planner.tuner
    return {"rule": t.rule, "locked": t.locked, "table": t.table, "used": used,
            "dense_calls": state.dense_calls - dense_before, "plan": str(state.plan)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case,expect", [("fast", "allgather"), ("near_tie", "dense"),
                                         ("rank_disagrees", "dense")])
def test_tuner_picks_fastest_and_prefers_dense(case, expect):
    out = spawn(_injected, 2, case, timeout=120)
    for o in out:
        assert o["locked"] and o["rule"] == expect, o["plan"]
        assert o["table"] == out[0]["table"]
    if expect == "dense":
        assert out[0]["used"] == ["dense"] and out[0]["dense_calls"] > 0  # dense buckets are accounted too
    else:
        assert out[0]["used"] == [expect]
    if case == "rank_disagrees":
        assert dict((r, s) for r, s, _ in out[0]["table"])["allgather"] == 1.5


def test_choose_rule_and_schedule_without_processes():
    assert choose_rule([("dense", 1.0, 2), ("a", 0.96, 2)], 0.03) == "a"
    assert choose_rule([("dense", 1.0, 2), ("a", 0.97, 2)], 0.03) == "dense"  # needs > 3%
    assert choose_rule([("dense", 1.0, 2), ("a", 0.5, 2), ("b", 0.5, 2)], 0.03) == "a"  # tie: earlier
    assert choose_rule([("dense", 1.0, 2), ("a", math.nan, 0)], 0.03) == "dense"
    # millisecond steps: 10% faster but only 0.4 ms saved is noise, not a reason to compress
    assert choose_rule([("dense", 0.004, 3), ("a", 0.0036, 3)], 0.03) == "dense"
    assert choose_rule([("dense", 0.004, 3), ("a", 0.0036, 3)], 0.03, min_gain=1e-4) == "a"
    # schedule: interleaved rounds of 3 steps per rule from step 4; the first step of each
    # block is not counted; y (slower than x, ranges apart, but within the decisive 10%)
    # stays until min_rounds (4); y beats dense by less than the decisive 10%, so dense runs
    # in every round
    t = Autotuner(steps_per_trial=3, trials=2)
    per_step = {"dense": 1.0, "x": 0.85, "y": 0.91}
    clock, rules, agreed = 0.0, [], []
    for step in range(4, 48):
        rules.append(t.begin_step(step, clock, lambda: ["x", "y", "z"], lambda v: agreed.append(v) or v))
        first = len(rules) == 1 or rules[-1] != rules[-2] or (len(rules) > 3 and rules[-4:-1] == [rules[-1]] * 3)
        clock += per_step[rules[-1]] + (5.0 if first else 0.0)  # switching costs are not counted
    assert rules[:9] == ["dense"] * 3 + ["x"] * 3 + ["y"] * 3
    assert rules[9:36] == (["dense"] * 3 + ["x"] * 3 + ["y"] * 3) * 3 and rules[36:] == ["x"] * 8
    assert [len(a) for a in agreed] == [9, 9, 9, 9]
    assert [(r, round(s, 6)) for r, s, _ in t.table] == [("dense", 1.0), ("x", 0.85), ("y", 0.91)]
    sd = t.state_dict()
    t2 = Autotuner()
    t2.load_state_dict(sd)
    assert t2.locked and t2.rule == "x"
    with pytest.raises(ValueError, match="autotune_steps"):
        Autotuner(steps_per_trial=1)
    with pytest.raises(TypeError, match="autotune"):
        comms.CompressionState("fp16", algorithm="auto", autotune="yes")
    with pytest.raises(ValueError, match="retune"):
        comms.CompressionState("fp16", algorithm="allreduce").retune()


class _FakeComm:
    def __init__(self, rank, world):
        self.rank, self.world_size = rank, world


def test_flush_owner_residual_offsets():
    x = torch.zeros(10)
    store = {"two_phase_residual": torch.arange(1.0, 5.0)}  # m = ceil(10 / 3) = 4
    assert get_algorithm("two_phase").flush_residual_(x, store, _FakeComm(2, 3))
    assert x.tolist() == [0] * 8 + [1.0, 2.0]  # rank 2 owns [8, 12): the padding is dropped
    assert not get_algorithm("two_phase").flush_residual_(x, {}, _FakeComm(0, 3))
    for name in ("allreduce", "allgather", "shared_scale"):  # they keep no residual
        assert not get_algorithm(name).flush_residual_(x, store, _FakeComm(0, 3))

    class Tiered(_FakeComm):
        intra, inter = _FakeComm(1, 2), _FakeComm(1, 2)

    y = torch.zeros(8)  # shard 4 per local rank, inter chunk 2: local 1, inter 1 -> [6, 8)
    get_algorithm("hier_two_phase").flush_residual_(y, {"two_phase_residual": torch.tensor([5.0, 6.0])}, Tiered(3, 4))
    assert y.tolist() == [0] * 6 + [5.0, 6.0]


# -- residuals when a bucket switches to dense: nothing is lost, nothing arrives in a burst ------
LOCK = 9  # the first step of the locked dense plan in _conservation


def _conservation(rank, world, alg):
    from comms.core.engine import DRAIN_STEPS as RESIDUAL_DRAIN_STEPS

    fake = {"dense": 1.0, alg: 2.0}  # the compressed trial is slower: dense gets locked
    model, state, _ = _ddp("topk:density=0.05", steps_per_trial=2, candidates=[alg],
                           timing=lambda rule, s: fake[rule], lr=0.0)
    replica = make_model()
    reduced, local, mem, owner = [], [], [], []
    # start 1: dense 1-2, compressed 3-4, dense 5-6, compressed 7-8 (a rule is dropped after two
    # samples), dense locked from LOCK
    for step in range(LOCK + 1 + RESIDUAL_DRAIN_STEPS):
        x, y = batch(rank, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        reduced.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        replica.zero_grad()
        nn.functional.cross_entropy(replica(x), y).backward()
        local.append(torch.cat([p.grad.reshape(-1).clone() for p in replica.parameters()]))
        owner.append(sum(float(d["two_phase_residual"].abs().sum()) for d in state.algo_store.values()
                         if "two_phase_residual" in d))
        mem.append(sum(float(r.abs().sum()) for r in state.memory.residuals.values()))
    return {"reduced": torch.stack(reduced), "local": torch.stack(local), "mem": mem, "owner": owner,
            "drain": RESIDUAL_DRAIN_STEPS, "left": dict(state.memory.draining),
            "rule": state.planner.tuner.rule, "rules_ok": state.planner.tuner.trials == ["dense", alg]}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("alg", ["allgather", "two_phase"])
def test_switch_to_dense_drains_residuals(alg):
    out = spawn(_conservation, 2, alg, timeout=120)
    assert all(o["rule"] == "dense" and o["rules_ok"] for o in out)
    assert torch.equal(out[0]["reduced"], out[1]["reduced"])
    k = out[0]["drain"]
    for o in out:
        # residual mass existed during the compressed trial; the algorithm's own store (two_phase's
        # owner residual) is flushed at the switch, the hook's residual leaves in k equal shares
        last = LOCK - 1  # the last compressed trial step
        assert o["mem"][last] > 1e-3 and o["owner"][LOCK] == 0 and o["left"] == {}
        # a trial's dense steps keep the residual (compression comes back)
        assert o["mem"][5] == o["mem"][6] == o["mem"][4] > 1e-3
        for i in range(k):
            assert o["mem"][LOCK + i] == pytest.approx(o["mem"][last] * (k - 1 - i) / k, rel=1e-4, abs=1e-6)
        assert o["mem"][LOCK + k - 1] == 0 and o["mem"][-1] == 0
    true_avg = (out[0]["local"] + out[1]["local"]) / 2
    applied = out[0]["reduced"]
    # every bit of gradient sent over the whole run arrived: sum over steps is conserved
    torch.testing.assert_close(applied.sum(0), true_avg.sum(0), rtol=0, atol=2e-5)
    # ... and it would not be without the drain: the compressed steps alone lose mass
    assert (applied[:LOCK].sum(0) - true_avg[:LOCK].sum(0)).abs().max() > 1e-3
    # no burst: after the switch, each dense step carries at most its own gradient plus one
    # share of the residual (plus the owner flush at the switch step itself)
    excess = (applied[LOCK + 1:LOCK + k] - true_avg[LOCK + 1:LOCK + k]).abs().sum(1)
    share = sum(o["mem"][LOCK - 1] for o in out) / k  # residuals are in averaged units (x / world)
    assert float(excess.max()) <= share * 1.01 + 1e-5


def _kept_through_trials(rank, world):
    fake = {"dense": 4.0, "allgather": 1.0}  # random-k wins past its quality margin: trials, a lock, watchdog checks
    model, state, _ = _ddp("randomk:density=0.05", candidates=["allgather"],
                           timing=lambda rule, s: fake[rule], lr=0.0)
    tuner = state.planner.tuner
    tuner.watch_every = 3
    rules, mem = [], []
    for step in range(24):
        x, y = batch(rank, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        rules.append(tuner.rule)
        mem.append({k: r.clone() for k, r in state.memory.residuals.items()})
    return {"rules": rules, "mem": mem, "params": flat_params(model.module),
            "draining": dict(state.memory.draining), "decision": tuner.decision}


@pytest.mark.timeout(150)
def test_trial_and_watchdog_dense_steps_keep_the_residual():
    """Dense steps that a trial or a watchdog check runs while compression stays the decision
    leave the error-feedback residual as it is (it returns with the compressed steps): adding
    random-k's residual at each of them made 10x steps and loss spikes."""
    out = spawn(_kept_through_trials, 2, timeout=120)
    assert out[0]["decision"] == "allgather" and out[0]["rules"] == out[1]["rules"]
    rules = out[0]["rules"]
    checked = 0
    for o in out:
        for t in range(1, len(rules)):
            if rules[t] == "dense" and o["mem"][t - 1]:  # a dense step after compressed ones
                assert o["mem"][t].keys() == o["mem"][t - 1].keys()
                for k in o["mem"][t]:
                    assert torch.equal(o["mem"][t][k], o["mem"][t - 1][k]), (t, k)
                checked += 1
        assert o["draining"] == {}
    # trial rounds after the first and at least one watchdog check (after the lock) were seen
    assert checked >= 4 and "dense" in rules[rules.index("allgather"):]


def _screened(rank, world, spec):
    # a measured dense step of 1 s: no plan of the tiny model's buckets is predicted to save
    # 25% of it (random-k's screen: half its 50% margin)
    model, state, opt = _ddp(spec)
    tuner, rules = state.planner.tuner, []
    tuner.timing = lambda rule, s: 1.0
    for step in range(8):
        _step(rank, model, opt, step)
        rules.append(tuner.rule)
    comms.check_replicas(model)
    return {"rules": rules, "screen": tuner.screen, "locked": tuner.locked, "decision": tuner.decision,
            "tuning_steps": tuner.tuning_steps, "screened": sorted(tuner.screened), "reason": tuner.reason,
            "compressed": sum(s.calls for s in state.stats.values() if s.algorithm != "dense")}


@pytest.mark.timeout(150)
def test_a_plan_the_model_cannot_see_winning_never_runs_a_trial_step():
    """random-k's trial steps cost quality (its residual leaves in bursts): register sets the
    tuner's screen, dense's first-round steps are agreed alone, and with no rule predicted to
    save its share of dense's step dense is locked before any compressed step ran."""
    out = spawn(_screened, 2, "randomk:density=0.05", timeout=120)
    for o in out:
        assert o["screen"] == 0.5 and o["locked"] and o["decision"] == "dense", o
        assert o["tuning_steps"] == 2 and o["compressed"] == 0 and o["screened"], o
        assert o["reason"].startswith("no compressed rule tried: the cost model predicts"), o["reason"]
        assert o["rules"][0] is None and o["rules"][1:] == ["dense"] * 7  # step 0: before start_iter
    assert out[0]["screened"] == out[1]["screened"] and out[0]["reason"] == out[1]["reason"]
    # a quantizer's trial steps cost no quality: no screen, its rules run their trials
    q = spawn(_screened, 2, "qsgd:bits=4", timeout=120)
    assert q[0]["screen"] == 0.0 and q[0]["screened"] == [] and q[0]["compressed"] > 0
    # top-k's dense steps fall in its 5-step warm-up ramp (not counted for the trials): the
    # screen counts them, dense steps either way
    k = spawn(_screened, 2, "topk:density=0.1", timeout=120)
    assert k[0]["screen"] == 0.5 and k[0]["screened"] and k[0]["compressed"] == 0 and k[0]["tuning_steps"] == 2


# -- resume keeps the locked plan ---------------------------------------------------------------
def _first(rank, world, ckpt):
    fake = {"dense": 1.0, "allgather": 0.5, "two_phase": 0.8}
    model, state, opt = _ddp("topk:density=0.1", candidates=["allgather", "two_phase"],
                             timing=lambda rule, s: fake[rule])
    for step in range(30):  # locked after 4 interleaved rounds of 3 rules (two_phase stays to round 4)
        _step(rank, model, opt, step)
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "comm": state.state_dict()},
               os.path.join(ckpt, f"rank{rank}.pt"))
    for step in range(30, 34):
        _step(rank, model, opt, step)
    return {"params": flat_params(model.module), "rule": state.planner.tuner.rule}


def _resumed(rank, world, ckpt):
    model, state, opt = _ddp("topk:density=0.1", timing=lambda rule, s: {"dense": 0.1}.get(rule, 9.0))
    ck = torch.load(os.path.join(ckpt, f"rank{rank}.pt"), weights_only=True)
    model.module.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["comm"])
    for step in range(30, 34):
        _step(rank, model, opt, step)
    t = state.planner.tuner
    return {"params": flat_params(model.module), "rule": t.rule, "locked": t.locked,
            "retuned": t.start is not None, "saved_rule": ck["comm"]["planner"]["autotune"]["rule"]}


@pytest.mark.timeout(150)
def test_resume_keeps_locked_plan(tmp_path):
    full = spawn(_first, 2, str(tmp_path), timeout=100)
    assert full[0]["rule"] == "allgather"
    resumed = spawn(_resumed, 2, str(tmp_path), timeout=100)
    for r in range(2):
        o = resumed[r]
        # the resumed run's fake timings would make dense win: it must not have re-tuned
        assert o["locked"] and o["rule"] == "allgather" == o["saved_rule"] and not o["retuned"]
        assert torch.equal(o["params"], full[r]["params"]), f"rank {r}: resumed run diverged"
