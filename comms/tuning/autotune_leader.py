"""The autotuner's standing plan before it locks: what ``auto``'s outer-sync choice weighs at
each round's end (:mod:`comms.tuning.outer_choice`), and the lock that ends the tuning when
the outer sync takes over.

The leader is the rule the tuner would lock now: the best of those that beat dense with
confidence (:meth:`~comms.tuning.autotune_rules.DecisionRules._wins`) at the last round's end,
from round 2 on. After round 1 (one counted step per rule: no confidence test applies yet) a
rule leads only when its counted step takes at most :data:`EARLY_LEAD` of dense's fastest step
in that round and its uncounted first step (its buffers, its first codec calls) no longer than
dense's fastest; the outer sync must then beat it by :data:`EARLY_MARGIN`
(:func:`leader_margin`), unless every step of it, the first included, took at most
:data:`EARLY_SURE` of dense's. On a link that slow a second round only adds dense steps at 1.4x
the compressed step or more (the 25M MLP at 1 Gb/s: dense 1.0 s, qsgd4 0.33 s, the outer sync's
step 0.16 s; the 12.7M transformer under AdamW: dense 0.79-0.83 s, the compressed rules' counted
steps 0.60-0.70x of it and their first steps up to 0.92x, the outer sync's step 0.36-0.43 s, a
second round 2 s more). It is offered once per round, the same on every rank (agreed step
times).
"""

from __future__ import annotations

import math

from ..algorithms import DENSE
from .autotune import medians
from .outer_choice import MARGIN

__all__ = ["EARLY_LEAD", "EARLY_MARGIN", "EARLY_SURE", "leader", "leader_margin", "lock_leader"]

#: after round 1, a rule leads when its counted step took at most this fraction of dense's
#: fastest (one round at 10 Gb/s: the rules within 0.8-1.2x dense)
EARLY_LEAD = 0.75
#: a round-1 leader whose every step, the first included, took at most this fraction of dense's
#: fastest is weighed as a confirmed one is: a gap no load burst fakes (the 25M MLP at 1 Gb/s:
#: qsgd4 0.33-0.35 of dense, the outer sync's predicted step x its extra steps 0.30-0.31: a
#: margin would turn a 2x faster step down)
EARLY_SURE = 0.5
#: what the outer sync must win by against any other round-1 leader, whose step is one sample:
#: the prediction errs slow (4-18% above the measured outer step on the 12.7M transformer), so
#: the margin adds to one already there; at 10% the transformer's round-1 leaders (469-502 ms
#: against a predicted 397 x 1.05) passed by 2-9% and one run's did not
EARLY_MARGIN = 0.05


def _round_one_gaps(t) -> dict[str, tuple[float, float]]:
    """``{rule: (its counted step / dense's fastest, its slowest step / dense's fastest)}`` of
    the rules with a counted step in round 1 (empty without a finite dense step)."""
    steps: dict[str, list[float]] = {}
    for r, v in t._phase_steps:
        steps.setdefault(r, []).append(v)
    dense = steps.pop(DENSE, None)
    if not dense or not all(math.isfinite(v) for v in dense):
        return {}
    fastest = min(dense)
    return {r: (max(t._samples[r]) / fastest, max(vs) / fastest) for r, vs in steps.items()
            if vs and t._samples.get(r) and all(math.isfinite(v) for v in vs)}


def _early(t) -> str | None:
    """The rule leading after round 1 (see the module docstring), or None: the fastest counted
    step of those under :data:`EARLY_SURE` in every step (no margin to pay), else of the rest."""
    gaps = _round_one_gaps(t)
    sure = {r: g for r, (g, slowest) in gaps.items() if slowest <= EARLY_SURE}
    lead = sure or {r: g for r, (g, slowest) in gaps.items() if g <= EARLY_LEAD and slowest <= 1.0}
    return min(lead, key=lead.get) if lead else None


def leader(t) -> tuple[str, list[tuple[str, float, int]]] | None:
    """``(rule, table)`` of autotuner ``t`` once per round while it tunes: the leading rule and
    every rule's median so far, in the form of ``t.table``; ``None`` when no rule leads, the
    phase is locked, or this round's leader was offered already."""
    if t.locked or t._rounds < 1 or t._leader_round == t._rounds:
        return None
    rule = _early(t) if t._rounds == 1 else t._pick(t._winners)[0] if t._winners else None
    if rule is None:
        return None
    t._leader_round, t._offered = t._rounds, rule
    return rule, medians(t)


def leader_margin(t) -> float:
    """How much faster than the plan of autotuner ``t`` the outer sync must step:
    :data:`EARLY_MARGIN` against a leader after round 1 above :data:`EARLY_SURE` of dense's
    step, else :data:`~comms.tuning.outer_choice.MARGIN` (from round 2 the confidence test
    stands behind the leader; a locked plan had its rounds)."""
    return EARLY_MARGIN if not t.locked and t._rounds == 1 and not _sure(t) else MARGIN


def _sure(t) -> bool:
    """Whether every round-1 step of the rule :func:`leader` offered, the first included, took
    at most :data:`EARLY_SURE` of dense's fastest."""
    return _round_one_gaps(t).get(t._offered, (0.0, math.inf))[1] <= EARLY_SURE


def lock_leader(t, why: str) -> None:
    """Lock the rule :func:`leader` offered last; its reason ends with ``why`` and the round."""
    reason = None
    if t._rounds == 1:  # no confidence test yet: the reason is the round-1 gap
        gap = (f"every step, the first included, within {EARLY_SURE:.0%} of dense's fastest" if _sure(t)
               else f"its counted step within {EARLY_LEAD:.0%} of dense's fastest and its first no slower")
        reason = f"{gap} in round 1; {why} in round 1"
    t._lock([t._offered], f"{why} in round {t._rounds}", reason=reason)
