"""Decisions that change training, printed at Python's default log level.

A stock run configures no logging, and Python then prints WARNING and above to stderr. So
commpress logs each decision that changes how a run trains at WARNING, one line each — from
rank 0 where every rank takes the same decision, from the rank concerned otherwise:

* what ``algorithm="auto"`` locked (DDP: the plan; FSDP/HSDP: each module's route), a
  re-tune after the lock, and a move to communicating every H steps;
* the Adam(W) variance freeze and its step (momentum-space compression starts there);
* a checkpoint without commpress state while compressing, an optimizer restored from a
  commpress run whose commpress state was not loaded, an optimizer momentum set back to 0.

A rank loading another rank's state raises ``ValueError`` instead. Everything else commpress
logs is INFO or DEBUG. Silence these with ``logging.getLogger("comms").setLevel(logging.ERROR)``.
"""

from __future__ import annotations

import logging

__all__ = ["notice"]


def notice(logger: logging.Logger, msg: str, *args, rank: int | None = None) -> None:
    """Log ``msg % args`` at WARNING on ``logger`` when ``rank`` is 0 or ``None`` (the rank
    concerned, or a decision only this process takes)."""
    if rank in (None, 0):
        logger.warning(msg, *args)
