"""The step autotuner's margin over dense from a compressor's extra steps to dense's loss
(comms.tuning.quality_cost): a plan faster per step but slower to quality locks dense."""

import pytest

import compressors
from comms.tuning.autotune import Autotuner
from comms.tuning.quality_cost import STEPS_FOR_DENSE_LOSS, prefer_dense_for, screen_for, steps_for_dense_loss


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


def screened_drive(tuner, cost, steps, gains):
    """Like :func:`drive` with the planner's ``predict`` (``gains``: seconds saved per step);
    returns the rules and the agreed rounds' lengths."""
    clock, rules, agreed = 0.0, [], []
    for step in range(steps):
        rule = tuner.begin_step(step, clock, lambda: ["a", "b"],
                                lambda v: agreed.append(len(v)) or v, lambda: dict(gains))
        rules.append(rule)
        clock += cost[rule]
    return rules, agreed


@pytest.mark.parametrize("spec,adaptive,want", [
    ("topk:density=0.01", False, 0.5), ("randomk:density=0.01", False, 0.5),
    ("sign", False, 0.5), ("powersgd:rank=1", False, 0.5),
    ("sign", True, 0.0), ("qsgd:bits=4", False, 0.0), ("fp16", False, 0.0),
])
def test_only_a_compressor_whose_trial_steps_cost_quality_is_screened(spec, adaptive, want):
    assert screen_for(compressors.from_spec(spec), adaptive) == want


def test_rules_the_model_cannot_see_winning_are_never_tried():
    # random-k 1% at 10 Gb/s: dense 366 ms, the model predicts 62 ms saved where 50% of the
    # step (183 ms) is needed, 91 ms at the screen's half
    margin = prefer_dense_for(compressors.from_spec("randomk:density=0.01"))
    t = Autotuner(steps_per_trial=2, trials=2, prefer_dense=margin, screen=0.5)
    cost = {"dense": 0.366, "a": 0.32, "b": 0.35}
    rules, agreed = screened_drive(t, cost, 12, {"dense": 0.0, "a": 0.062, "b": 0.061})
    # dense's two first-round steps alone, one agreement, then dense is locked: a and b never ran
    assert rules == ["dense"] * 12 and agreed == [2]
    assert t.locked and t.decision == "dense" and t.tuning_steps == 2
    assert t.screened == {"a": 0.062, "b": 0.061}
    assert "no compressed rule tried" in t.reason and "62.0 ms" in t.reason and "366 ms" in t.reason
    line = t.lock_summary()
    assert line.startswith("autotune locked 'dense' (1.00x") and "tuning took 2 steps, 0 ms" in line


def test_a_rule_the_model_sees_winning_runs_and_the_first_round_keeps_its_length():
    # 1 Gb/s: dense 1 s, the model predicts a saves 0.7 s; b (0.05 s) is screened. Dense's
    # first-round steps are not repeated: the first round is dense, dense, a, a as without
    # the screen, agreed in two parts
    margin = prefer_dense_for(compressors.from_spec("topk:density=0.01"))
    t = Autotuner(steps_per_trial=2, trials=2, prefer_dense=margin, screen=0.5)
    cost = {"dense": 1.0, "a": 0.3, "b": 0.95}
    rules, agreed = screened_drive(t, cost, 20, {"dense": 0.0, "a": 0.7, "b": 0.05})
    assert rules[:4] == ["dense", "dense", "a", "a"] and "b" not in rules
    assert agreed[:2] == [2, 2]
    assert t.locked and t.decision == "a", t.reason
    assert t.screened == {"b": 0.05}
    # a rule with no prediction (nan) is tried
    u = Autotuner(steps_per_trial=2, trials=2, prefer_dense=margin, screen=0.5)
    rules, _ = screened_drive(u, cost, 8, {"dense": 0.0, "a": float("nan"), "b": 0.05})
    assert rules[:4] == ["dense", "dense", "a", "a"] and u.screened == {"b": 0.05}


def test_without_a_screen_or_a_prediction_the_rounds_are_unchanged():
    cost = {"dense": 0.366, "a": 0.32, "b": 0.35}
    for screen, gains in ((0.0, {"a": 0.0, "b": 0.0}), (0.5, None)):
        t = Autotuner(steps_per_trial=2, trials=2, prefer_dense=0.5, screen=screen)
        clock, rules, agreed = 0.0, [], []
        for step in range(8):
            rule = t.begin_step(step, clock, lambda: ["a", "b"], lambda v: agreed.append(len(v)) or v,
                                None if gains is None else (lambda: gains))
            rules.append(rule)
            clock += cost[rule]
        assert rules[:6] == ["dense", "dense", "a", "a", "b", "b"] and agreed[0] == 6
    with pytest.raises(ValueError, match="screen"):
        Autotuner(screen=1.5)


def test_the_screen_counts_dense_steps_inside_a_warm_up_ramp():
    # top-k's ramp (count_from) covers dense's first-round steps: they still weigh the screen
    t = Autotuner(steps_per_trial=2, trials=2, prefer_dense=0.29, screen=0.5)
    t.count_from = 5
    rules, agreed = screened_drive(t, {"dense": 0.4, "a": 0.3, "b": 0.3}, 6, {"a": 0.01, "b": 0.02})
    assert t.locked and t.decision == "dense" and rules == ["dense"] * 6 and agreed == [2]
    assert t.table[0] == ("dense", 0.4, 1)
