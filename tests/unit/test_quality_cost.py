"""The step autotuner's margin over dense from a compressor's extra steps to dense's loss
(comms.tuning.quality_cost): a plan faster per step but slower to quality locks dense."""

import pytest

import compressors
from comms.tuning.autotune import Autotuner
from comms.tuning.quality_cost import STEPS_FOR_DENSE_LOSS, prefer_dense_for, steps_for_dense_loss


def drive(tuner, cost, steps):
    clock, rules = 0.0, []
    for step in range(steps):
        rule = tuner.begin_step(step, clock, lambda: ["a"], lambda v: v)
        rules.append(rule)
        clock += cost[rule]
    return rules


@pytest.mark.parametrize("spec,adaptive,want", [
    ("topk:density=0.01", False, 1 - 1 / 1.4),
    ("powersgd:rank=1", False, 1 - 1 / 1.5),
    ("randomk:density=0.01", True, 1 - 1 / 2.0),
    ("sign", False, 1 - 1 / 1.6),
    ("sign", True, 0.03),  # in Adam's momentum space sign reached dense's loss in dense's steps
    ("qsgd:bits=4", False, 0.03),
    ("fp16", True, 0.03),
])
def test_the_margin_is_what_the_extra_steps_take_back(spec, adaptive, want):
    c = compressors.from_spec(spec)
    assert prefer_dense_for(c, adaptive) == pytest.approx(want)
    # a plan exactly that much faster than dense reaches dense's loss in dense's time
    assert steps_for_dense_loss(c, adaptive) * (1 - want) == pytest.approx(1.0) or want == 0.03


def test_a_plan_faster_per_step_but_slower_to_quality_locks_dense():
    # top-k 1% stepping 16% faster than dense (10 Gb/s, 25M MLP) needs 1.4x the steps
    cost = {"dense": 0.287, "a": 0.242}
    base = Autotuner(steps_per_trial=2, trials=1)
    drive(base, cost, 40)
    assert base.locked and base.decision == "a"  # by step time alone it compresses
    tuned = Autotuner(steps_per_trial=2, trials=1,
                      prefer_dense=prefer_dense_for(compressors.from_spec("topk:density=0.01")))
    rules = drive(tuned, cost, 40)
    assert tuned.locked and tuned.decision == "dense", tuned.reason
    assert "by 29%" in tuned.reason
    assert rules[-4:] == ["dense"] * 4
    # 3x faster (1 Gb/s): the margin does not bind, and dense retires from the rounds early
    fast = Autotuner(steps_per_trial=2, trials=1, prefer_dense=tuned.prefer_dense)
    drive(fast, {"dense": 1.0, "a": 0.3}, 40)
    assert fast.locked and fast.decision == "a"


def test_dense_does_not_retire_before_a_rule_beats_the_margin():
    # 15% faster beats the decisive 10% but not top-k's 29% margin: dense keeps running trial
    # steps (a retired dense would make the rule a winner for good)
    cost = {"dense": 1.0, "a": 0.85}
    t = Autotuner(steps_per_trial=2, trials=1, prefer_dense=1 - 1 / STEPS_FOR_DENSE_LOSS["topk"])
    rules = drive(t, cost, 40)
    assert t.decision == "dense" and not t._dense_retired
    assert rules[:12].count("dense") == 6
