"""The autotuner's decision rules with injected step times (one process, no communication):
interleaved rounds, clear winners, ties and noise prefer dense, the step budget, the
watchdog re-tuning on drift, checkpointing."""

import math
import random
import statistics

import pytest

from comms.tuning import autotune_rules
from comms.tuning.autotune import Autotuner


def drive(tuner, times, steps, start=0, agreed=None):
    """Run ``steps`` steps; ``times(rule, step)`` is the step's duration. Returns the rules."""
    clock, rules = 0.0, []
    for step in range(start, start + steps):
        rule = tuner.begin_step(step, clock, lambda: ["a", "b", "c"],
                                lambda v: (agreed.append(list(v)) if agreed is not None else None) or v)
        rules.append(rule)
        clock += times(rule, step)
    return rules


def test_rounds_are_interleaved_and_a_clear_winner_locks_after_min_rounds():
    t = Autotuner(steps_per_trial=2, trials=3)
    agreed = []
    cost = {"dense": 1.0, "a": 0.92, "b": 0.95, "c": 1.4}
    rules = drive(t, lambda r, s: cost[r], 36, agreed=agreed)
    # round 1: every rule for 2 steps, in order; then only the live ones
    assert rules[:8] == ["dense", "dense", "a", "a", "b", "b", "c", "c"]
    # c is slower than every dense step: dropped after round 2 (one sample each is one stray
    # step away from the opposite); b also beats dense and is within the decisive 10% of a, so
    # it stays until min_rounds (a few samples cannot separate close plans), then a's lead
    # decides; neither beats dense by the decisive 10%, so dense runs in every round
    assert rules[8:16] == ["dense", "dense", "a", "a", "b", "b", "c", "c"]
    assert rules[16:28] == ["dense", "dense", "a", "a", "b", "b"] * 2
    assert t.locked and t.decision == "a" and rules[28:] == ["a"] * 8
    assert [len(v) for v in agreed] == [8, 8, 6, 6]
    # round 1 counts each rule's second step (the first allocates), later rounds every step
    assert [(r, n) for r, _, n in t.table] == [("dense", 7), ("a", 7), ("b", 7), ("c", 3)]
    assert t.tuning_steps == 28
    # the tuning cost is every tuning step's time beyond a's 0.92 s
    assert t.tuning_cost_s == pytest.approx(sum(cost[r] for r in rules[:28]) - 28 * 0.92)


def test_dense_beaten_decisively_by_every_live_rule_runs_no_more_trials():
    # a and b both beat dense by far more than the decisive 10% but are within 10% of each
    # other: the phase stays open until min_rounds, and from round 3 on only a and b run
    cost = {"dense": 1.0, "a": 0.5, "b": 0.54, "c": 1.4}
    # (c, slower than dense, runs rounds 1 and 2)
    for decisive, dense_steps, steps, sizes in ((0.10, 4, 8 + 8 + 4 + 4, [8, 8, 4, 4]),
                                                (0.0, 8, 8 + 8 + 2 * 6, [8, 8, 6, 6])):
        t = Autotuner(steps_per_trial=2, trials=3, decisive=decisive)
        agreed = []
        rules = drive(t, lambda r, s: cost[r], 36, agreed=agreed)
        assert rules[:16] == ["dense", "dense", "a", "a", "b", "b", "c", "c"] * 2
        assert rules[:steps].count("dense") == dense_steps, (decisive, rules)
        assert [len(v) for v in agreed] == sizes
        assert t.locked and t.decision == "a" and t.tuning_steps == steps
        assert rules[steps:] == ["a"] * (36 - steps)
        # dense keeps its samples (the table, the watchdog's runner-up is dense)
        # (round 1's first dense step is the only one not counted)
        assert dict((r, n) for r, _, n in t.table)["dense"] == dense_steps - 1
        assert t.tuning_cost_s == pytest.approx(sum(cost[r] for r in rules[:steps]) - steps * 0.5)
    # a live rule within the decisive margin of dense (b) keeps dense in every round: a beats
    # dense by more than 10%, b by less, and a and b are within 10% of each other (no early
    # lock either); a little noise does not change that
    rng = random.Random(5)
    t = Autotuner(steps_per_trial=2, trials=2)
    rules = drive(t, lambda r, s: {"dense": 1.0, "a": 0.86, "b": 0.93}[r] * (1 + rng.uniform(-0.01, 0.01)), 40)
    assert t.decision == "a" and t.tuning_steps == 4 * 6
    assert rules[:24] == ["dense", "dense", "a", "a", "b", "b"] * 4


def test_a_decisive_result_locks_from_round_two():
    # a beats dense and b by far more than the decisive 10% (and 3 standard errors): locked
    # after round 2 instead of min_rounds (4); with decisive=0 the same timings take 4 rounds
    cost = {"dense": 1.0, "a": 0.6, "b": 0.8, "c": 1.4}
    for decisive, steps in ((0.10, 8 + 8), (0.0, 8 + 8 + 2 * 6)):  # c runs rounds 1-2
        rng = random.Random(3)
        t = Autotuner(steps_per_trial=2, trials=3, decisive=decisive)
        rules = drive(t, lambda r, s: cost[r] * (1 + rng.uniform(-0.02, 0.02)), 40)
        assert t.locked and t.decision == "a" and t.tuning_steps == steps, (decisive, t.table)
        assert rules[steps:] == ["a"] * (40 - steps)
    # round 1 alone never decides (one sample each: no spread measured)
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: {"dense": 1.0, "a": 0.3}[r], 4)
    assert not t.locked
    # a second winner within 10% of the best keeps the phase open until min_rounds
    t = Autotuner(steps_per_trial=2, trials=2)
    drive(t, lambda r, s: {"dense": 1.0, "a": 0.6, "b": 0.64}[r], 40)
    assert t.decision == "a" and t.tuning_steps == 2 * 6 + 2 * 4  # dense retired after round 2
    # and so does a best that beats dense by less than the decisive margin
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: {"dense": 1.0, "a": 0.93}[r], 40)
    assert t.decision == "a" and t.tuning_steps == 4 * 4
    with pytest.raises(ValueError, match="decisive"):
        Autotuner(decisive=1.0)


def test_a_burst_after_dense_retired_does_not_undo_the_win():
    # as measured at 10 Gb/s (sign): allgather and two_phase beat dense decisively in rounds
    # 1-2, so dense retired; a load burst in round 4 lifted both above dense's fastest early
    # step. With no dense steps left to pair with, the win over dense must stay: a is locked
    burst = {3}  # 0-based: the fourth round, before min_rounds could lock
    rng = random.Random(7)
    cost = {"dense": 1.0, "a": 0.72, "b": 0.76}

    def times(rule, step):
        # rounds: 0-1 have 6 steps (dense, a, b), later ones 4 (a, b)
        rnd = step // 6 if step < 12 else 2 + (step - 12) // 4
        slow = 1.45 if rule != "dense" and rnd in burst else 1.0
        return cost[rule] * slow * (1 + rng.uniform(-0.02, 0.02))

    t = Autotuner(steps_per_trial=2, trials=2)
    rules = drive(t, times, 44)
    assert rules[:12] == ["dense", "dense", "a", "a", "b", "b"] * 2
    assert "dense" not in rules[12:t.tuning_steps], rules  # retired after round 2
    assert t.locked and t.decision == "a", t.table
    # the burst left a's range overlapping b's: both stay in play to the budget
    assert t.tuning_steps == 40


def test_one_stalled_step_neither_drops_nor_disqualifies_a_faster_plan():
    # a is 10% faster than dense, but its first counted step (step 3) stalls to 1.3 s: after
    # round 1 it is slower than every dense step, yet it keeps running (two samples each before
    # anything is dropped); the stall keeps its range overlapping dense's for good, and the
    # rank test locks it once 7 samples each (1 + 2 + 2 + 2: from round 2 every step counts)
    # put it ahead in 42 of 49 pairs (>= 85%)
    cost = {"dense": 1.0, "a": 0.9}
    t = Autotuner(steps_per_trial=2, trials=1)
    rules = drive(t, lambda r, s: 1.3 if s == 3 else cost[r], 40)
    assert rules[4:8] == ["dense", "dense", "a", "a"]
    assert t.locked and t.decision == "a", t.table
    assert t.tuning_steps == 4 * 4 and dict((r, n) for r, _, n in t.table) == {"dense": 7, "a": 7}
    # one more stall (step 7, counted in round 2): 35 of 49 pairs at round 4; the rank test
    # needs 15 samples each (195 of 225 pairs, 87%): round 8
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: 1.3 if s in (3, 7) else cost[r], 40)
    assert t.locked and t.decision == "a" and t.tuning_steps == 8 * 4
    # three stalls (3 of 19 samples at the budget: 304 of 361 pairs, 84%): dense
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: 1.3 if s in (3, 7, 11) else cost[r], 44)
    assert t.locked and t.decision == "dense" and t.tuning_steps == 40
    # the same a with no stall wins as before: disjoint, after min_rounds (4)
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: cost[r], 40)
    assert t.decision == "a" and t.tuning_steps == 4 * 4


def test_ties_and_small_gains_lock_dense():
    for gain in (0.0, 0.02):  # equal, or 2% (< the 3% margin)
        t = Autotuner(steps_per_trial=2, trials=1)
        drive(t, lambda r, s: 1.0 if r == "dense" else 1.0 - gain, 40)
        assert t.locked and t.decision == "dense", (gain, t.table)


def test_noise_alone_rarely_compresses_and_the_budget_holds():
    # three candidates exactly as fast as dense, +-20% step-to-step noise, 100 seeded tunings
    compressed = 0
    for seed in range(100):
        rng = random.Random(seed)
        t = Autotuner(steps_per_trial=2, trials=3, max_steps=40)
        rules = drive(t, lambda r, s: 1 + rng.uniform(-0.2, 0.2), 50)
        assert t.locked and t.tuning_steps <= 40
        assert rules[t.tuning_steps:].count(t.decision) == 50 - t.tuning_steps
        compressed += t.decision != "dense"
    assert compressed <= 4, compressed


def test_noisy_but_clear_winner_is_found():
    rng = random.Random(1)
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: (1.0 if r == "dense" else 0.6) * (1 + rng.uniform(-0.1, 0.1)), 40)
    assert t.locked and t.decision == "a"


def test_a_plan_faster_in_every_round_wins_under_load_that_moves_both(monkeypatch):
    # the load of a shared machine moves whole rounds (x0.7-1.3) and each step by +-2% on
    # top: a is 10% faster than dense within every round, but across rounds its samples
    # overlap dense's (no disjoint win, no 85% rank win): only the test paired by round
    # sees it, from PAIRED_MIN_ROUNDS rounds on
    def tune():
        rng = random.Random(2)
        load = {}

        def times(rule, step):
            k = step // 4  # rounds of dense, dense, a, a (one candidate)
            load.setdefault(k, rng.uniform(0.7, 1.3))
            return load[k] * (1.0 if rule == "dense" else 0.9) * (1 + rng.uniform(-0.02, 0.02))

        t = Autotuner(steps_per_trial=2, trials=1)
        rules = drive(t, times, 44)
        return t, rules

    t, rules = tune()
    samples = t._samples
    assert autotune_rules.faster_pairs(samples["a"], samples["dense"]) < autotune_rules.RANK_WIN
    assert not max(samples["a"]) < min(samples["dense"])
    assert t.locked and t.decision == "a"
    assert t.tuning_steps == 4 * autotune_rules.PAIRED_MIN_ROUNDS  # min_rounds = 4 = the paired minimum
    assert rules[t.tuning_steps:] == ["a"] * (44 - t.tuning_steps)
    # the same timings without the paired test: undecided until the budget, then dense
    monkeypatch.setattr(autotune_rules, "PAIRED_T", math.inf)
    t, _ = tune()
    assert t.decision == "dense" and t.tuning_steps == 40
    # and a paired gain under the 3% margin never wins, however consistent
    monkeypatch.undo()
    rng = random.Random(4)
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: (1.0 if r == "dense" else 0.98) * (1 + rng.uniform(-0.001, 0.001)), 40)
    assert t.decision == "dense"


def test_round_one_skips_each_rules_first_step_and_later_rounds_count_every_step():
    # a's first step of the phase (step 2) allocates: 5 s, not counted; its first step of
    # round 2 (step 6) is counted like every later step (measured: within 1-2% of the next)
    cost = {"dense": 1.0, "a": 0.9}
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: 5.0 if s == 2 else cost[r], 40)
    assert t.decision == "a" and t.tuning_steps == 4 * 4
    assert t._samples["a"] == pytest.approx([0.9] * 7)
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: 0.95 if s == 6 else cost[r], 40)
    assert t._samples["a"][:3] == pytest.approx([0.9, 0.95, 0.9])


def test_no_step_of_the_warm_up_ramp_is_counted():
    # the compressor's warm-up (steps 0-4): a's milder variants take 3 s a step; the planner
    # sets count_from = start_iter + warmup_steps, so none of them is a sample of a or dense
    cost = {"dense": 1.0, "a": 0.9}
    ramp = lambda r, s: 3.0 if (r == "a" and s < 5) else cost[r]  # noqa: E731
    t = Autotuner(steps_per_trial=2, trials=1)
    t.count_from = 5
    drive(t, ramp, 40)
    assert t.decision == "a" and t._samples["a"] == pytest.approx([0.9] * len(t._samples["a"])), t._samples
    # round 1 (steps 0-3) and step 4 (dense) are the ramp's: dense counts from step 5, a from
    # its round-2 block (steps 6-7); 4 rounds of 4 steps
    assert [(r, n) for r, _, n in t.table] == [("dense", 5), ("a", 6)] and t.tuning_steps == 16
    t = Autotuner(steps_per_trial=2, trials=1)  # counted from the start, the ramp is a sample
    drive(t, ramp, 40)
    assert t._samples["a"][0] == 3.0


# rounds' load on a shared machine (x0.75-1.3): unpaired, the rules' samples all overlap
ROUND_LOAD = [1.0, 1.25, 0.8, 1.1, 0.9, 1.2, 0.85, 1.05, 0.95, 1.15, 0.75, 1.3]


def test_a_rule_that_surely_cannot_win_is_dropped_and_no_longer_holds_the_phase_open(monkeypatch):
    # rounds of dense, dense, a, a, b, b under load that moves whole rounds: a is 5% faster
    # (+-8% per step), b as fast as dense within 0.5% in every round. Unpaired, b overlaps
    # dense and stays undecided, holding the phase open to the budget (36 steps); paired, from
    # PAIRED_MIN_ROUNDS rounds b is surely not 3% faster: dropped, and a locks at round 4
    def times(rule, step):
        rng = random.Random(step)
        f = {"dense": 1.0, "a": 0.95 * (1 + rng.uniform(-0.08, 0.08)), "b": 1.0 + 0.005 * (-1) ** step}[rule]
        return ROUND_LOAD[step // 6 % len(ROUND_LOAD)] * f

    t = Autotuner(steps_per_trial=2, trials=2)
    rules = drive(t, times, 44)
    assert rules[:24] == ["dense", "dense", "a", "a", "b", "b"] * 4
    assert t.decision == "a" and t.tuning_steps == 24 and rules[24:] == ["a"] * 20
    assert t._paired_loses("b") and not t._paired_loses("a")
    monkeypatch.setattr(autotune_rules, "PAIRED_DROP_T", math.inf)
    t = Autotuner(steps_per_trial=2, trials=2)
    rules = drive(t, times, 44)
    assert rules[:36] == ["dense", "dense", "a", "a", "b", "b"] * 6 and t.tuning_steps == 36


def test_the_paired_test_takes_at_least_the_spread_pooled_over_the_rules():
    # a's rounds happen to agree closely (-4.7% / -5.5% vs dense) while b, on the same
    # machine, moves by +-25% from round to round: a's own spread, from a few rounds, is
    # likely too small; with the pooled spread a 5% gain is not clear in 36 steps (dense)
    def times(rule, step):
        k = step // 6
        f = {"dense": 1.0, "a": 0.95 * (1 + 0.004 * (-1) ** k), "b": 0.8 if k % 2 else 1.25}[rule]
        return ROUND_LOAD[k % len(ROUND_LOAD)] * f

    t = Autotuner(steps_per_trial=2, trials=2)
    drive(t, times, 44)
    assert t.decision == "dense"
    x = t._paired_log_ratios("a")
    assert t._paired_sd(x) > 5 * statistics.stdev(x)


def test_a_dropped_rule_leaves_the_pooled_spread():
    # b is 30-160% slower than dense with stalls (top-k's two_phase at 10 Gb/s): dropped after
    # round 2, its two wild rounds leave the pool, and a (9% faster, +-3% per step, under load
    # that moves whole rounds) wins the paired test at round 4 on its own spread: 20 steps.
    # Pooled over every rule tried, b's spread held a off until round 7 (32 steps)
    def times(rule, step):
        rng = random.Random(step)
        k = step // 6 if step < 12 else 2 + (step - 12) // 4  # rounds of 6 steps, then of 4
        f = {"dense": 1.0, "a": 0.91 * (1 + rng.uniform(-0.03, 0.03)), "b": (1.3, 2.6)[step % 2]}[rule]
        return ROUND_LOAD[k % len(ROUND_LOAD)] * f

    t = Autotuner(steps_per_trial=2, trials=2)
    rules = drive(t, times, 44)
    assert rules[:20] == ["dense", "dense", "a", "a", "b", "b"] * 2 + ["dense", "dense", "a", "a"] * 2
    assert t.decision == "a" and t.tuning_steps == 20
    assert autotune_rules.faster_pairs(t._samples["a"], t._samples["dense"]) < autotune_rules.RANK_WIN


def test_near_tied_winners_lock_the_preferred_rule_in_nearly_every_tuning():
    # a and b both beat dense by ~40%; b is 1.5% faster on average, under +-5% step noise: the
    # preferred rule a is locked in >= 90% of tunings, where picking the fastest mean
    # (tie=0) follows the noise
    def decisions(tie, cost_b, seeds=40):
        out = []
        for seed in range(seeds):
            rng = random.Random(seed)
            t = Autotuner(steps_per_trial=2, trials=2, tie=tie)
            t.preference = {"a": 0, "b": 1}.get
            cost = {"dense": 1.0, "a": 0.6, "b": cost_b}
            drive(t, lambda r, s: cost[r] * (1 + rng.uniform(-0.05, 0.05)), 50)
            assert t.tuning_steps <= 40
            out.append(t.decision)
        return out

    assert decisions(0.03, 0.591).count("a") >= 36
    assert decisions(0.0, 0.591).count("a") <= 15
    # 8% apart is not a tie: the faster one wins whatever the preference
    assert decisions(0.03, 0.55) == ["b"] * 40
    # without a preference, ties keep the trial order (the cost model's ranking)
    t = Autotuner(steps_per_trial=2, trials=2)
    drive(t, lambda r, s: {"dense": 1.0, "a": 0.6, "b": 0.595}[r], 50)
    assert t.decision == "a"


def test_watchdog_retunes_when_the_locked_plan_drifts_and_dense_wins():
    t = Autotuner(steps_per_trial=2, trials=1, watch_every=10)
    link = {"slow": True}

    def times(rule, step):
        if step >= 20:  # the link got fast: compression no longer pays
            link["slow"] = False
        if rule == "dense":
            return 1.0 if link["slow"] else 0.3
        return 0.5
    rules = drive(t, times, 60)
    assert "a" in rules[:20] and t.tunings >= 2, (t.tunings, rules)
    assert t.locked and t.decision == "dense", str(t)
    assert rules[-10:].count("dense") >= 8  # the lock, but for a watchdog check of a


def test_watchdog_keeps_a_lock_that_still_wins():
    t = Autotuner(steps_per_trial=2, trials=1, watch_every=10)
    rules = drive(t, lambda r, s: 1.0 if r == "dense" else 0.5, 60)
    assert t.tunings == 1 and t.decision == "a"
    checks = [i for i in range(1, 60) if rules[i] == "dense" and rules[i - 1] == "a"]
    assert checks, "the watchdog re-timed dense"  # and went back to the lock after each check
    assert all(rules[i + 2] == "a" for i in checks if i + 2 < 60)


def test_lock_summary_says_what_was_locked_why_and_its_cost_in_one_line():
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: 1.0 if r == "dense" else 0.5, 20)
    # a beats dense in every step by far more than 10%: locked after round 2 (8 steps), the
    # 4 steps it did not run cost 4 x 0.5 s beyond it
    assert t.lock_summary() == (
        "autotune locked 'a' (2.00x dense's median step; every step faster than every dense "
        "step, beyond 3 standard errors; decisive by 10%, locked in round 2); tuning took "
        "8 steps, 2000 ms beyond the locked plan")
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: 1.0 if r == "dense" else 0.99, 20)
    assert t.decision == "dense" and t.lock_summary() == (
        "autotune locked 'dense' (1.00x dense's median step; no compressed rule beat dense's "
        "median by 3% and 1 ms with confidence; every rule decided); tuning took 16 steps, "
        "0 ms beyond the locked plan")
    t2 = Autotuner()
    t2.load_state_dict(t.state_dict())
    assert "restored from a checkpoint" in t2.lock_summary()


def test_state_dict_round_trip_and_options():
    t = Autotuner(steps_per_trial=2, trials=1)
    drive(t, lambda r, s: 1.0 if r == "dense" else 0.5, 20)
    t2 = Autotuner()
    t2.load_state_dict(t.state_dict())
    assert t2.locked and t2.decision == "a" and t2.tuning_steps == t.tuning_steps
    assert "locked 'a'" in str(t2) and math.isfinite(t2.table[0][1])
    with pytest.raises(ValueError, match="autotune_steps"):
        Autotuner(steps_per_trial=1)
    with pytest.raises(ValueError, match="max_steps"):
        Autotuner(steps_per_trial=4, max_steps=3)
    with pytest.raises(ValueError, match="drift"):
        Autotuner(drift=0)
    with pytest.raises(ValueError, match="tie"):
        Autotuner(tie=1.5)


def test_plan_reports_model_error_per_tried_rule():
    import torch

    from comms.tuning.planner import Plan, PlanRow

    t = Autotuner()
    t.load_state_dict({"locked": True, "rule": "allgather",
                       "table": [["dense", 0.5, 4], ["allgather", 0.497, 4], ["model", 0.499, 4]]})
    rows = [PlanRow(0, 1000, torch.float32, 4000, "allgather", "cheapest",
                    {"dense": 0.010, "allgather": 0.004, "two_phase": 0.006}, "two_phase"),
            PlanRow(1, 10, torch.float32, 40, "dense", "small (< 16384 elements)",
                    {"dense": 0.001, "allgather": 0.0001}, "dense")]
    errors = Plan(rows, None, None, t).model_errors()
    assert errors["allgather"] == (pytest.approx(-0.006), pytest.approx(-0.003))
    assert errors["model"] == (pytest.approx(-0.004), pytest.approx(-0.001))  # the model's picks
    assert "allgather predicted -6.0 measured -3.0" in str(Plan(rows, None, None, t))


def test_garbage_timings_raise_a_named_error_before_any_rule_sees_them():
    """After a peer dies gloo may hand the timing MAX-allgather back with garbage; the rules'
    ``statistics`` then overflowed ("integer division result too large for a float")."""
    from comms.tuning.autotune import MAX_STEP_SECONDS, MIN_STEP_SECONDS, check_step_seconds

    ok = [0.5, math.nan, MIN_STEP_SECONDS, 1e-4, MAX_STEP_SECONDS * 0.999]
    assert check_step_seconds(ok, "commpress: t") is ok
    # zeros too: they reached the paired log-ratios as "math domain error" (a killed peer)
    for bad in (1e300, -0.25, math.inf, MAX_STEP_SECONDS, 0.0, 5e-324):
        with pytest.raises(RuntimeError, match=r"^commpress: t returned .* a peer died") as e:
            check_step_seconds([0.5, bad], "commpress: t")
        # the same advice as every other failed collective: what to do next
        assert "restart from the last checkpoint" in str(e.value) and "\n" not in str(e.value)


def test_planner_agreement_checks_what_the_collective_returned():
    import torch

    from comms.tuning.planner import Planner

    class GarbageComm:  # an allgather that "completes" with what a dead peer's pair left
        rank, world_size, timeout, backend = 0, 2, 5.0, "gloo"

        def all_gather(self, t):
            fut = torch.futures.Future()
            fut.set_result(torch.cat([t, torch.full_like(t, 3e305)]))
            return fut

    planner = Planner.__new__(Planner)
    planner.comm = GarbageComm()
    with pytest.raises(RuntimeError, match="autotune timing MAX-allgather .* returned 3e"):
        planner._agree([0.5, math.nan])
