"""Communicate every ``H`` steps: the outer sync of the DiLoCo family (:mod:`comms.outer.sync`),
its fragments and schedule, its outer optimizers. Used by ``comms.register(..., sync_every=H)``
(DDP) and ``comms.fsdp.register(..., replicate_group=..., sync_every=H)`` (HSDP)."""

from .fragments import Schedule, split_fragments
from .optimizers import OUTER_OPTIMIZERS, OuterOptimizer
from .sync import OuterSync

__all__ = ["OuterSync", "OuterOptimizer", "OUTER_OPTIMIZERS", "Schedule", "split_fragments"]
