"""Checkpointing the autotuner: a locked decision (and its trial table) is saved and restored
as plain values; an unfinished trial phase is not (it starts afresh after a restore)."""

from __future__ import annotations


__all__ = ["tuner_state", "load_tuner_state"]


def tuner_state(t) -> dict:
    """``t``'s decision as plain values (see :meth:`comms.tuning.autotune.Autotuner.state_dict`)."""
    return {"locked": t.locked, "rule": t.decision if t.locked else None,
            "table": [[r, float(s), int(n)] for r, s, n in t.table],
            "tuning_steps": t.tuning_steps, "tuning_cost_s": float(t.tuning_cost_s)}


def load_tuner_state(t, sd: dict) -> None:
    """Restore :func:`tuner_state` into ``t``: a locked decision is kept (no re-tuning); an
    unfinished trial phase starts afresh. Validates before changing anything.

    Raises:
        TypeError: ``sd`` is not such a dict, or a locked state names no rule.
    """
    if not isinstance(sd, dict) or not isinstance(sd.get("locked"), bool):
        raise TypeError(f"autotune state must be a dict from Autotuner.state_dict(), got {sd!r}")
    if sd["locked"] and not isinstance(sd.get("rule"), str):
        raise TypeError(f"a locked autotune state needs a rule name, got {sd.get('rule')!r}")
    t.reset()
    if sd["locked"]:
        t.locked, t.rule, t.decision = True, sd["rule"], sd["rule"]
        t.table = [(str(r), float(s), int(n)) for r, s, n in sd.get("table", [])]
        t.trials = [r for r, _, _ in t.table]
        t.tuning_steps = int(sd.get("tuning_steps", 0))
        t.tuning_cost_s = float(sd.get("tuning_cost_s", 0.0))
        t.reason = "restored from a checkpoint"
