"""The DDP entry points: ``make_hook`` (a state and the hook function) and ``register`` (the
hook on a DDP model, paired with its optimizer: :mod:`comms.core.pairing`)."""

from __future__ import annotations

import logging
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel

from ..core.pairing import (ADAM_FREEZE_DEFAULT, adam_pairing, check_adam_freeze, check_pairing,
                            give_back_momentum, pair_optimizer, replica_guard)
from ..outer.attach import attach_outer, check_outer_pairing, take_sync_options
from ..outer.optimizers import is_adaptive
from ..tuning.quality_cost import prefer_dense_for, screen_for
from .hook import compression_hook
from .outer_switch import skip_reducer
from .state import CompressionState

__all__ = ["make_hook", "register"]


logger = logging.getLogger(__name__)


def make_hook(compressor, *, process_group=None, error_feedback: bool | None = None, start_iter: int = 2,
              **kwargs):
    """Build ``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    Args:
        compressor: a :class:`compressors.Compressor` or a spec string such as
            ``"topk:density=0.01"``, ``"qsgd:bits=4"``, ``"sign"``.
        process_group: the group to average over; ``None`` is WORLD. Any subgroup works.
        error_feedback: keep residuals per bucket; ``None``: on for biased compressors only.
        start_iter: iterations of plain allreduce first.
        **kwargs: forwarded to :class:`~comms.ddp.state.CompressionState` (``algorithm``: default ``"auto"``, the per-bucket cost-model planner;
            ``seed``, ``communicator``, ``min_compress_numel``).

    Example::

        >>> state, hook = comms.make_hook("qsgd:bits=4")
        >>> ddp_model.register_comm_hook(state, hook)
    """
    kwargs.setdefault("algorithm", "auto")  # the cost-model planner (comms.tuning.planner)
    state = CompressionState(compressor, process_group, error_feedback=error_feedback,
                             start_iter=start_iter, **kwargs)
    return state, compression_hook


def register(ddp_model, compressor, *, check_replicas_every: int | None = None,
             optimizer=None, adam_freeze=ADAM_FREEZE_DEFAULT, **kwargs) -> CompressionState:
    """Register the compression hook on a DDP model and return its state.

    Args:
        ddp_model: the ``DistributedDataParallel`` model.
        compressor: a :class:`compressors.Compressor` or a spec string.
        check_replicas_every: ``N`` > 0: :func:`comms.check_replicas` every ``N`` steps (with
            the outer sync: the synced parameters every ``N`` syncs); ``None``/0: off.
        optimizer: the training optimizer (recommended; :mod:`comms.core.pairing`): SGD momentum
            is taken over as the hook's momentum correction (PowerSGD's stays); Adam/AdamW with
            top-k, random-k or sign goes to momentum space (:mod:`comms.core.adam`).
        adam_freeze: with such an Adam optimizer: ``"auto"`` (the default: the variance
            freezes once it settles), an int (the step it freezes at), or ``None`` (compress the
            gradient). A value other than ``None`` where no Adam pairing applies (no optimizer,
            not Adam/AdamW, a compressor that keeps the gradient path) is an error.
        **kwargs: as :func:`make_hook`; the outer sync's (:mod:`comms.outer`) ``sync_every=H``
            (``0``: never; default: ``auto`` may choose it), ``sync_fragments``, ``sync_delay``,
            ``outer``, ``outer_lr``, ``outer_momentum``.

    Raises:
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel``.
        ValueError: a bad spec or option, an optimizer of another model, an ``adam_freeze`` that
            does not apply, a model with a hook already (nothing is registered).

    Example: ``state = comms.register(ddp_model, "topk:density=0.01", optimizer=opt)``."""
    if not isinstance(ddp_model, DistributedDataParallel):
        hint = ("; for FSDP2 (fully_shard) models use comms.fsdp.register(model, spec)"
                if _is_fsdp2(ddp_model) else "")
        raise TypeError(f"register() needs a torch.nn.parallel.DistributedDataParallel model, "
                        f"got {type(ddp_model).__name__}{hint}")
    if getattr(ddp_model, "_commpress_state", None) is not None:
        raise ValueError(f"this DistributedDataParallel model already has a commpress hook "
                         f"({ddp_model._commpress_state.compressor.spec()!r}); DDP allows one "
                         "communication hook per model")
    check_adam_freeze(adam_freeze)  # its value; check_pairing: whether it applies
    sync, auto_outer = take_sync_options(kwargs)
    if sync is not None:  # communicate every H steps: the gradients stay local in between
        return _register_outer(ddp_model, compressor, optimizer, adam_freeze, sync, check_replicas_every, kwargs)
    guard = replica_guard(ddp_model.module, check_replicas_every)  # validated first
    state, taken = pair_optimizer(optimizer, lambda **kw: make_hook(compressor, **kw)[0], kwargs,
                                  check=lambda probe: check_pairing(probe, optimizer, adam_freeze,
                                                                    ddp_model.module.named_parameters()))
    state.bind(ddp_model)
    state.replica_guard = guard
    _quality_margin(state, optimizer)
    try:  # ValueError: an Adam layout the update cannot follow; RuntimeError: DDP has a hook
        state.adam = adam_pairing(state, optimizer, adam_freeze)
        _allow_outer(state, ddp_model, optimizer, auto_outer, check_replicas_every,
                     taken.momentum if taken else None)  # the SGD momentum an outer switch gives back
        ddp_model.register_comm_hook(state, compression_hook)
    except (ValueError, RuntimeError) as exc:
        give_back_momentum(optimizer, taken)  # nothing half-applied (the optimizer's mark too)
        if state.adam is not None:
            state.adam.remove()
        if isinstance(exc, ValueError):
            raise
        raise ValueError(f"cannot register the commpress hook ({state.compressor.spec()!r}): {exc}") from exc
    ddp_model._commpress_state = state
    return state


def _quality_margin(state, optimizer) -> None:
    """The step autotuner locks a compressed plan only when its step beats dense's by what the
    compressor's extra steps to dense's loss take back, and tries it only when the cost model
    predicts it can (:mod:`comms.tuning.quality_cost`)."""
    tuner = state.planner.tuner if state.planner is not None else None
    if tuner is not None:
        tuner.prefer_dense = prefer_dense_for(state.compressor, is_adaptive(optimizer), tuner.prefer_dense)
        tuner.screen = screen_for(state.compressor, is_adaptive(optimizer))


def _allow_outer(state, ddp_model, optimizer, auto_outer, check_every, taken) -> None:
    """What ``auto`` needs to switch to the outer sync later (:mod:`comms.ddp.outer_switch`)."""
    params = [p for p in ddp_model.module.parameters() if p.requires_grad]
    state.numel = sum(p.numel() for p in params)
    if auto_outer and state.algorithm == "auto" and optimizer is not None:
        state.auto_outer = (optimizer, params, check_every, taken, weakref.ref(ddp_model))


def _register_outer(ddp_model, compressor, optimizer, adam_freeze, sync, check_every, kwargs) -> CompressionState:
    """``register(..., sync_every=H)``: the hook keeps each rank's gradients local; the outer
    sync (:mod:`comms.outer`) runs after the optimizer's steps."""
    check_outer_pairing(optimizer, adam_freeze, kwargs, ADAM_FREEZE_DEFAULT)
    if check_every is not None and (isinstance(check_every, bool) or not isinstance(check_every, int)
                                    or check_every < 0):
        raise ValueError(f"check_replicas_every must be an int >= 0 or None, got {check_every!r}")
    state = make_hook(compressor, **kwargs)[0]  # validates every option first
    params = [p for p in ddp_model.module.parameters() if p.requires_grad]
    state.outer = attach_outer(params, state.comm(), state.compressor, optimizer, sync, check_every, kwargs)
    state.bind(ddp_model)
    try:
        ddp_model.register_comm_hook(state, compression_hook)
    except RuntimeError as exc:  # DDP refuses a second hook of any kind
        state.outer.hook_handle.remove()
        raise ValueError(f"cannot register the commpress hook ({state.compressor.spec()!r}): {exc}") from exc
    skip_reducer(ddp_model)
    ddp_model._commpress_state = state
    return state


def _is_fsdp2(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in model.modules())


