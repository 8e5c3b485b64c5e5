"""Wiring the outer sync into an entry point: its options, what does not apply with it, and the
optimizer's step post-hook it runs from (``register(..., sync_every=H)``: DDP and HSDP)."""

from __future__ import annotations

from .optimizers import default_outer
from .sync import OuterSync

__all__ = ["SYNC_OPTIONS", "take_sync_options", "check_outer_pairing", "attach_outer"]

#: ``register`` keywords of the outer sync (see :class:`~comms.outer.sync.OuterSync`)
SYNC_OPTIONS = ("sync_every", "sync_fragments", "sync_delay", "outer", "outer_lr", "outer_momentum")
#: per-step options that do not apply when gradients stay local between syncs
_PER_STEP = ("momentum", "momentum_masking", "clip_norm", "warmup_steps", "start_iter", "min_compress_numel",
             "autotune", "autotune_steps")
#: what the pseudo-gradient's engine state takes from the user's options
_PSEUDO = ("error_feedback", "seed", "timeout", "residual_bound", "algorithm")


def take_sync_options(kwargs: dict) -> tuple[dict | None, bool]:
    """Remove the outer-sync keywords from ``kwargs``; returns ``(sync, auto)``: ``sync`` the
    keywords when ``sync_every=H`` pins the outer sync, else ``None``; ``auto``: whether
    ``algorithm="auto"`` may choose it (``sync_every`` left out or ``"auto"``; ``0``: never).
    Other outer-sync keywords without a pinned ``sync_every`` are an error."""
    present = {k: kwargs.pop(k) for k in SYNC_OPTIONS if k in kwargs}
    every = present.get("sync_every")
    if every in (None, "auto", 0) and not isinstance(every, bool):
        extra = sorted(k for k, v in present.items() if k != "sync_every" and v is not None)
        if extra:
            raise ValueError(f"{extra} configure the outer sync: pass sync_every=H too")
        return None, every != 0
    return present, False


def check_outer_pairing(optimizer, adam_freeze, options: dict, default_freeze) -> None:
    """Before anything changes: the outer sync needs the optimizer (it runs after its steps),
    and per-step options do not apply (gradients stay local between syncs)."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"sync_every needs optimizer=opt (a torch.optim.Optimizer: the outer sync "
                         f"runs after its steps), got {type(optimizer).__name__}")
    if adam_freeze is not default_freeze and adam_freeze is not None:
        raise ValueError(f"adam_freeze={adam_freeze!r} does not apply with sync_every: the inner "
                         "optimizer trains on local gradients, Adam's state stays local")
    bad = [k for k in _PER_STEP if options.get(k) is not None]
    if bad:
        raise ValueError(f"{bad} configure per-step gradient compression; with sync_every the "
                         "gradients stay local between syncs (the inner optimizer keeps its momentum)")


def attach_outer(params, comm, compressor, optimizer, sync: dict, check_every, options: dict) -> OuterSync:
    """An :class:`OuterSync` over ``params`` on ``comm``, run after every step of ``optimizer``."""
    outer = OuterSync(params, comm, compressor, every=sync["sync_every"],
                      fragments=sync.get("sync_fragments") or 1, delay=sync.get("sync_delay") or 0,
                      outer=sync.get("outer") or default_outer(sync.get("outer_momentum")), outer_lr=sync.get("outer_lr"),
                      outer_momentum=sync.get("outer_momentum"), check_every=check_every or None,
                      **{k: options[k] for k in _PSEUDO if options.get(k) is not None})
    outer.hook_handle = optimizer.register_step_post_hook(outer.after_step)
    return outer
