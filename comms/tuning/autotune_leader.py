"""The autotuner's standing plan before it locks: what ``auto``'s outer-sync choice weighs at
each round's end (:mod:`comms.tuning.outer_choice`), and the lock that ends the tuning when
the outer sync takes over.

The leader is the rule the tuner would lock now: the best of those that beat dense with
confidence (:meth:`~comms.tuning.autotune_rules.DecisionRules._wins`) at the last round's end,
from round 2 on. It is offered once per round, the same on every rank (agreed step times).
"""

from __future__ import annotations

from .autotune import medians

__all__ = ["leader", "lock_leader"]


def leader(t) -> tuple[str, list[tuple[str, float, int]]] | None:
    """``(rule, table)`` of autotuner ``t`` once per round while it tunes: the leading rule and
    every rule's median so far, in the form of ``t.table``; ``None`` when no rule leads, the
    phase is locked, or this round's leader was offered already."""
    if t.locked or t._rounds < 2 or t._leader_round == t._rounds or not t._winners:
        return None
    t._leader_round = t._rounds
    return t._pick(t._winners)[0], medians(t)


def lock_leader(t, why: str) -> None:
    """Lock ``t``'s leader now; its reason ends with ``why`` and the round."""
    t._lock(t._winners, f"{why} in round {t._rounds}")
