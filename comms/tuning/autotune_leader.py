"""The autotuner's standing plan before it locks: what ``auto``'s outer-sync choice weighs at
each round's end (:mod:`comms.tuning.outer_choice`), and the lock that ends the tuning when
the outer sync takes over.

The leader is the rule the tuner would lock now: the best of those that beat dense with
confidence (:meth:`~comms.tuning.autotune_rules.DecisionRules._wins`) at the last round's end,
from round 2 on. After round 1 (one counted step per rule: no confidence test applies yet) a
rule leads only when each of its steps, its uncounted first step included, takes at most
:data:`EARLY_LEAD` of dense's fastest step in that round: on a link that slow, a second round
only adds dense steps at several times the compressed step (the 25M MLP at 1 Gb/s: dense
1.0 s, qsgd4 0.33 s, the outer sync's step 0.16 s). It is offered once per round, the same on
every rank (agreed step times).
"""

from __future__ import annotations

import math

from ..algorithms import DENSE
from .autotune import medians

__all__ = ["EARLY_LEAD", "leader", "lock_leader"]

#: after round 1, a rule leads when every step of it took at most this fraction of dense's
#: fastest: a gap no load burst fakes (one round at 10 Gb/s: the rules within 0.8-1.2x dense)
EARLY_LEAD = 0.5


def _early(t) -> str | None:
    """The rule leading after round 1 (see the module docstring), or None."""
    steps: dict[str, list[float]] = {}
    for r, v in t._phase_steps:
        steps.setdefault(r, []).append(v)
    dense = steps.get(DENSE)
    if not dense or not all(math.isfinite(v) for v in dense):
        return None
    bar = EARLY_LEAD * min(dense)
    fast = [r for r, vs in steps.items()
            if r != DENSE and vs and t._samples.get(r) and all(math.isfinite(v) and v <= bar for v in vs)]
    return min(fast, key=lambda r: max(steps[r])) if fast else None


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


def lock_leader(t, why: str) -> None:
    """Lock the rule :func:`leader` offered last; its reason ends with ``why`` and the round."""
    reason = None
    if t._rounds == 1:  # no confidence test yet: the reason is the round-1 gap
        reason = (f"every step, the first included, within {EARLY_LEAD:.0%} of dense's fastest "
                  f"in round 1; {why} in round 1")
    t._lock([t._offered], f"{why} in round {t._rounds}", reason=reason)
