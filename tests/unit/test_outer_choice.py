"""``auto``'s choice between compressing every step and the outer sync (comms.tuning.outer_choice)."""

import math
import re

import pytest

import torch

import compressors
from comms.tuning.autotune import Autotuner
from comms.tuning.autotune_leader import EARLY_MARGIN, leader, leader_margin, lock_leader
from comms.tuning.cost_model import HOOK_PASSES, CostModel, TierCost
from comms.tuning.outer_choice import (MARGIN, MIN_EVERY, OUTER_PASSES, OUTER_STEPS, REDUCER_PASSES,
                                       choose_outer)


class _Tuner:
    def __init__(self, table, decision):
        self.locked, self.table, self.decision = True, table, decision


class _Planner:
    def __init__(self, link_bytes_per_s, table, decision="allgather"):
        self.tuner = _Tuner(table, decision)
        self.model = CostModel({"flat": TierCost("flat", 2, 1e-3, link_bytes_per_s)})

    def candidate_names(self):
        return ["allreduce", "allgather", "two_phase"]


def test_a_slow_link_moves_to_the_outer_sync_that_hides_its_transfer():
    # 25M parameters at 125 MB/s: a dense step's link time is most of its 0.9 s; the per-step
    # plan still steps 0.4 s, more than twice the compute left
    numel = 25_000_000
    p = _Planner(1.25e8, [("dense", 0.9, 6), ("allgather", 0.4, 6)])
    sync, why = choose_outer(p, compressors.from_spec("qsgd:bits=8"), numel, torch.float32)
    assert sync is not None, why
    every, frags, delay = sync["sync_every"], sync["sync_fragments"], sync["sync_delay"]
    assert every >= MIN_EVERY and every % frags == 0 and 0 <= delay < every // frags
    assert "every" in why and "fragments" in why


def test_a_faster_step_that_costs_more_steps_than_it_saves_keeps_compressing():
    # the outer step would be faster than the per-step plan's, but not by the extra steps the
    # outer sync needs to reach the same loss: time to quality decides, so per step stays
    numel = 25_000_000
    p = _Planner(1.25e8, [("dense", 0.9, 6), ("allgather", 0.23, 6)])
    compute = 0.9 - p.model.dense(numel, torch.float32)
    assert 0.23 > 1.15 * max(compute, 0.18)  # exposed: the first rule alone would switch
    sync, why = choose_outer(p, compressors.from_spec("qsgd:bits=8"), numel, torch.float32)
    assert sync is None and f"{OUTER_STEPS:g}x steps" in why, why


def test_powersgd_keeps_compressing_every_step_on_a_slow_link():
    # the slow link that moves qsgd to the outer sync leaves PowerSGD per step, saying why
    p = _Planner(1.25e8, [("dense", 0.9, 6), ("allreduce", 0.3, 6)], decision="allreduce")
    sync, why = choose_outer(p, compressors.from_spec("powersgd:rank=1"), 25_000_000, torch.float32)
    assert sync is None and "PowerSGD" in why and "diverged" in why


def test_a_fast_link_keeps_compressing_every_step():
    numel = 25_000_000
    p = _Planner(1.25e10, [("dense", 0.12, 6), ("allgather", 0.11, 6)])
    sync, why = choose_outer(p, compressors.from_spec("qsgd:bits=8"), numel, torch.float32)
    assert sync is None and "within" in why


def test_nothing_locked_decides_nothing():
    p = _Planner(1.25e8, [("dense", 0.9, 6), ("allgather", 0.2, 6)])
    p.tuner.locked = False
    assert choose_outer(p, compressors.from_spec("sign"), 1000, torch.float32)[0] is None
    p.tuner.locked, p.tuner.table = True, [("dense", math.nan, 0), ("allgather", 0.2, 6)]
    assert choose_outer(p, compressors.from_spec("sign"), 1000, torch.float32)[0] is None


def test_small_h_takes_two_fragments_that_each_overlap_a_step():
    # a transfer shorter than a step: H is the smallest, 2 fragments, each overlapping one step
    p = _Planner(1.25e8, [("dense", 0.9, 6), ("allgather", 0.4, 6)])
    sync, why = choose_outer(p, compressors.from_spec("qsgd:bits=4"), 25_000_000, torch.float32)
    assert sync is not None, why
    assert (sync["sync_every"], sync["sync_fragments"], sync["sync_delay"]) == (MIN_EVERY, 2, 1), sync


def test_adam_family_needs_fewer_extra_steps_so_switches_sooner():
    # a per-step plan between the two thresholds: SGD keeps it, Adam's family moves
    numel = 25_000_000
    p = _Planner(1.25e8, [("dense", 0.9, 6), ("allgather", 0.22, 6)])
    sgd, why_sgd = choose_outer(p, compressors.from_spec("qsgd:bits=4"), numel, torch.float32)
    adam, why = choose_outer(p, compressors.from_spec("qsgd:bits=4"), numel, torch.float32, adaptive=True)
    assert sgd is None and f"{OUTER_STEPS:g}x steps" in why_sgd, why_sgd
    assert adam is not None, why


def test_local_passes_count_per_round_against_and_per_step_for_the_outer_sync():
    # at the probed cost of a pass (1.33 ns per element) over 25M parameters: the outer sync
    # pays OUTER_PASSES per round of fragments (spread over H steps) and saves DDP's reducer
    # copies, REDUCER_PASSES every step (the engine's HOOK_PASSES come with the round's codec
    # work); the predicted step moves by exactly that balance
    numel, pass_ns = 25_000_000, 1.33
    p = _Planner(1.25e8, [("dense", 1.2, 6), ("allgather", 0.75, 6)])
    free, why_free = choose_outer(p, compressors.from_spec("qsgd:bits=4"), numel, torch.float32)
    p.model.mem_per_element = pass_ns * 1e-9
    paid, why_paid = choose_outer(p, compressors.from_spec("qsgd:bits=4"), numel, torch.float32)
    assert free is not None and paid is not None, (why_free, why_paid)
    assert paid["sync_every"] == free["sync_every"]

    def predicted_ms(why):
        return float(re.search(r"predicted step (\d+) ms", why).group(1))

    pass_ms = pass_ns * numel * 1e-6
    want = ((OUTER_PASSES + HOOK_PASSES) / free["sync_every"] - REDUCER_PASSES) * pass_ms
    assert abs(predicted_ms(why_paid) - predicted_ms(why_free) - want) <= 1.0, (why_free, why_paid)


def test_a_dense_lock_stays_dense():
    # the tuner locked dense (compression lost per step): a slow-looking table still keeps it
    p = _Planner(1.25e8, [("dense", 0.9, 6), ("allgather", 0.95, 6)], decision="dense")
    sync, why = choose_outer(p, compressors.from_spec("qsgd:bits=4"), 25_000_000, torch.float32)
    assert sync is None and "per-step plan is dense" in why, why


def test_a_standing_leader_is_weighed_before_the_lock():
    # an unlocked tuner decides nothing by itself; its leader's (rule, table) is weighed alike
    table = [("dense", 0.9, 6), ("allgather", 0.4, 6)]
    p = _Planner(1.25e8, table)
    locked, _ = choose_outer(p, compressors.from_spec("qsgd:bits=4"), 25_000_000, torch.float32)
    p.tuner.locked = False
    assert choose_outer(p, compressors.from_spec("qsgd:bits=4"), 25_000_000, torch.float32)[0] is None
    early, why = choose_outer(p, compressors.from_spec("qsgd:bits=4"), 25_000_000, torch.float32,
                              plan=("allgather", table))
    assert early is not None and early == locked, why
    assert choose_outer(p, compressors.from_spec("qsgd:bits=4"), 25_000_000, torch.float32,
                        plan=("dense", table))[0] is None


def _tune(tuner, cost, steps):
    clock = 0.0
    for step in range(steps):
        yield step, tuner.begin_step(step, clock, lambda: ["a", "b"], lambda v: v)
        clock += cost[tuner.rule]


def test_the_tuner_offers_its_leader_once_per_round_from_round_two():
    t = Autotuner(steps_per_trial=2, trials=2, max_steps=40)
    offered = []
    for step, _ in _tune(t, {"dense": 1.0, "a": 0.8, "b": 0.85}, 40):
        lead = leader(t)
        if lead is not None:
            offered.append((step, t._rounds, lead[0]))
            assert dict((r, s) for r, s, _ in lead[1]) == pytest.approx({"dense": 1.0, "a": 0.8, "b": 0.85})
        if t.locked:
            break
    rounds = [r for _, r, _ in offered]
    assert offered and rounds[0] == 2 and rounds == sorted(set(rounds)), offered  # once per round
    assert all(rule == "a" for _, _, rule in offered)
    assert leader(t) is None  # locked (or this round's leader given): nothing more to offer


def test_locking_the_leader_says_why_and_when():
    t = Autotuner(steps_per_trial=2, trials=2, max_steps=40)
    for _step, _ in _tune(t, {"dense": 1.0, "a": 0.85, "b": 0.8}, 40):
        if leader(t) is not None:
            break
    assert not t.locked
    lock_leader(t, "the outer sync takes over")
    assert t.locked and t.decision == "b" == t.rule
    assert t.reason.endswith("the outer sync takes over in round 2"), t.reason
    assert leader(t) is None and [r for r, _, _ in t.table] == ["dense", "a", "b"]


def _tune_by_step(tuner, cost, steps):
    """Like :func:`_tune`; ``cost(rule, step)`` gives each step's seconds."""
    clock = 0.0
    for step in range(steps):
        yield step, tuner.begin_step(step, clock, lambda: ["a", "b"], lambda v: v)
        clock += cost(tuner.rule, step)


@pytest.mark.parametrize("a, b, margin", [(0.7, 0.65, EARLY_MARGIN), (0.45, 0.4, MARGIN)])
def test_a_rule_within_three_quarters_of_dense_leads_after_round_one(a, b, margin):
    # a link that slow: a second round would only add dense steps at 1.4x the compressed step;
    # with one counted step each the outer sync must win by more, unless dense took twice as long
    t = Autotuner(steps_per_trial=2, trials=2, max_steps=40)
    for _step, _ in _tune(t, {"dense": 1.0, "a": a, "b": b}, 40):
        lead = leader(t)
        if lead is not None:
            break
    assert t._rounds == 1 and lead[0] == "b", (t._rounds, lead)
    assert leader_margin(t) == margin
    assert leader(t) is None  # once per round
    lock_leader(t, "the outer sync takes over")
    assert t.locked and t.decision == "b" == t.rule
    assert t.reason.endswith("the outer sync takes over in round 1"), t.reason
    assert ("every step, the first included, within 50%" in t.reason) == (margin == MARGIN), t.reason
    assert "round 1" in t.lock_summary()


def test_a_slow_first_step_below_dense_still_leads_after_round_one_with_a_margin():
    # the first step of a rule pays its buffers (the transformer: up to 0.92x dense's step)
    t = Autotuner(steps_per_trial=2, trials=2, max_steps=40)
    cold = {"dense": 1.0, "a": 0.95, "b": 0.9}
    first = {}
    for step, _ in _tune_by_step(t, lambda r, s: cold[r] if first.setdefault(r, s) == s else
                                 {"dense": 1.0, "a": 0.6, "b": 0.65}[r], 40):
        lead = leader(t)
        if lead is not None:
            break
    assert t._rounds == 1 and lead[0] == "a", (t._rounds, lead)
    assert leader_margin(t) == EARLY_MARGIN  # its first step was above half of dense's


def test_a_rule_at_half_of_dense_in_every_step_leads_before_a_faster_counted_step():
    # b's counted step is faster but its first was not within half of dense's: a leads, no margin
    t = Autotuner(steps_per_trial=2, trials=2, max_steps=40)
    first = {}
    for step, _ in _tune_by_step(t, lambda r, s: {"dense": 1.0, "a": 0.45, "b": 0.6}[r]
                                 if first.setdefault(r, s) == s else
                                 {"dense": 1.0, "a": 0.34, "b": 0.32}[r], 40):
        lead = leader(t)
        if lead is not None:
            break
    assert t._rounds == 1 and lead[0] == "a", (t._rounds, lead)
    assert leader_margin(t) == MARGIN


@pytest.mark.parametrize("cost", [
    lambda r, s: {"dense": 1.0, "a": 0.8, "b": 0.85}[r],  # a faster link: no rule within 75% of dense
    # a's first step (its buffers) slower than dense's fastest: not at round 1
    lambda r, s: {"dense": 1.0, "a": 0.4 if s != 2 else 1.05, "b": 0.85}[r],
    # one fast dense step in round 1 sets the bar
    lambda r, s: {"dense": 1.0 if s != 1 else 0.5, "a": 0.4, "b": 0.45}[r],
])
def test_no_early_leader_without_every_step_within_three_quarters_of_dense(cost):
    t = Autotuner(steps_per_trial=2, trials=2, max_steps=40)
    rounds = []
    for _step, _ in _tune_by_step(t, cost, 40):
        lead = leader(t)
        if lead is not None:
            rounds.append(t._rounds)
            assert leader_margin(t) == MARGIN  # from round 2: the confidence test stands behind it
        if t.locked:
            break
    assert 1 not in rounds, rounds


def test_the_early_margin_refuses_an_outer_sync_that_wins_by_less():
    # the outer sync's predicted step x its extra steps, against the leader's one counted step
    table = [("dense", 0.9, 1), ("allgather", 0.4, 1)]
    p = _Planner(1.25e8, table)
    p.tuner.locked = False
    c = compressors.from_spec("qsgd:bits=4")
    sync, why = choose_outer(p, c, 25_000_000, torch.float32, plan=("allgather", table))
    assert sync is not None, why
    predicted = float(re.search(r"predicted step (\d+) ms", why).group(1)) * 1e-3 * OUTER_STEPS
    tight = [("dense", 0.9, 1), ("allgather", predicted * (1 + EARLY_MARGIN / 2), 1)]
    assert choose_outer(p, c, 25_000_000, torch.float32, plan=("allgather", tight))[0] is not None
    refused, why = choose_outer(p, c, 25_000_000, torch.float32, plan=("allgather", tight),
                                margin=EARLY_MARGIN)
    assert refused is None and f"by {EARLY_MARGIN:.0%}" in why, why
