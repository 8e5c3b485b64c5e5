"""One-line entry points: ``make_hook`` and ``register``."""

from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel

from .hook import compression_hook
from .replicas import ReplicaGuard
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
        **kwargs: forwarded to :class:`~comms.state.CompressionState` (``algorithm``: default ``"auto"``, the per-bucket cost-model planner;
            ``seed``, ``communicator``, ``min_compress_numel``).

    Example::

        >>> state, hook = comms.make_hook("qsgd:bits=4")
        >>> ddp_model.register_comm_hook(state, hook)
    """
    kwargs.setdefault("algorithm", "auto")  # the cost-model planner (comms.planner)
    state = CompressionState(compressor, process_group, error_feedback=error_feedback,
                             start_iter=start_iter, **kwargs)
    return state, compression_hook


def register(ddp_model, compressor, *, check_replicas_every: int | None = None,
             **kwargs) -> CompressionState:
    """Register the compression hook on a DDP model and return its state.

    The state is bound to the model's parameter names (``state.bind``), so its bucket
    layouts survive a restart (bit-exact resume from ``state.state_dict()``).

    Args:
        ddp_model: the ``DistributedDataParallel`` model.
        compressor: a :class:`compressors.Compressor` or a spec string.
        check_replicas_every: ``N`` > 0 compares the parameters of all ranks (a fingerprint
            allgather, :func:`comms.check_replicas`) at the start of every ``N``-th step's
            backward and raises :class:`comms.ReplicaMismatchError` on every rank, naming the
            first differing parameter. ``None``/0: off.
        **kwargs: as :func:`make_hook`.

    Raises:
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel``.
        ValueError: bad compressor spec or options, or the model already has a hook
            (before any communication; nothing is registered).

    Example::

        >>> state = comms.register(ddp_model, "topk:density=0.01")
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register() needs a torch.nn.parallel.DistributedDataParallel model, "
                        f"got {type(ddp_model).__name__}")
    if getattr(ddp_model, "_commpress_state", None) is not None:
        raise ValueError(f"this DistributedDataParallel model already has a commpress hook "
                         f"({ddp_model._commpress_state.compressor.spec()!r}); DDP allows one "
                         "communication hook per model")
    guard = None
    if check_replicas_every:  # validated before anything is registered
        guard = ReplicaGuard(ddp_model.module, check_replicas_every)
    elif check_replicas_every not in (None, 0) or isinstance(check_replicas_every, bool):
        raise TypeError(f"check_replicas_every must be an int, got {check_replicas_every!r}")
    state, hook = make_hook(compressor, **kwargs)
    state.bind(ddp_model)
    state.replica_guard = guard
    try:
        ddp_model.register_comm_hook(state, hook)
    except RuntimeError as exc:  # DDP refuses a second hook of any kind
        raise ValueError(f"cannot register the commpress hook ({state.compressor.spec()!r}): "
                         f"{exc}") from exc
    ddp_model._commpress_state = state
    return state
