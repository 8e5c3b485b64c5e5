"""Accelerate: ``register(accelerator, model, compressor)`` — the commpress hook on a prepared model.

``DistributedDataParallelKwargs(comm_hook=...)`` accepts only Accelerate's own enum hooks, so
a custom hook goes on the model that ``accelerator.prepare`` returned: this helper finds the
``DistributedDataParallel`` inside it (unwrapping ``torch.compile``'s ``OptimizedModule``),
registers :func:`comms.register` there, and registers the state for checkpointing so that
``accelerator.save_state`` / ``load_state`` save and restore every rank's residuals (through
:class:`~comms.integrations.rank_states.RankStates`; call it before ``load_state``).

Example::

    >>> model, opt, loader = accelerator.prepare(model, opt, loader)
    >>> state = comms.integrations.accelerate.register(accelerator, model, "topk:density=0.01")
    >>> ...
    >>> accelerator.save_state("ckpt")      # every rank's commpress state included
"""

from __future__ import annotations

import logging

import torch
from torch.nn.parallel import DistributedDataParallel

from ..register import register as _register
from .rank_states import RankStates

__all__ = ["register", "find_ddp"]

logger = logging.getLogger(__name__)


def find_ddp(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` in ``model``, looking through ``torch.compile`` wrappers."""
    seen = 0
    while model is not None and seen < 8:
        if isinstance(model, DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        seen += 1
    return None


def register(accelerator, model: torch.nn.Module, compressor, *, checkpoint: bool = True, **kwargs):
    """Register the commpress hook on the model ``accelerator.prepare`` returned.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: what ``accelerator.prepare`` returned for the model (DDP, possibly compiled).
        compressor: a :class:`compressors.Compressor` or a spec string.
        checkpoint: register the state with ``accelerator.register_for_checkpointing``.
        **kwargs: as :func:`comms.register`.

    Returns:
        The :class:`comms.CompressionState`, or ``None`` on a single process (nothing to
        communicate; Accelerate does not wrap the model in DDP then).

    Raises:
        TypeError: several processes but no ``DistributedDataParallel`` in ``model`` (e.g. an
            FSDP or DeepSpeed plugin: for FSDP2 use :func:`comms.fsdp.register`).

    Example::

        >>> state = register(accelerator, model, "sign")
    """
    ddp = find_ddp(model)
    if ddp is None:
        if accelerator.num_processes == 1:
            logger.info("commpress: one process, no DistributedDataParallel: nothing registered")
            return None
        raise TypeError(f"no DistributedDataParallel in the prepared model ({type(model).__name__}); "
                        "commpress' Accelerate helper needs Accelerate's multi-process DDP "
                        "(for FSDP2 use comms.fsdp.register)")
    state = _register(ddp, compressor, **kwargs)
    if checkpoint:
        accelerator.register_for_checkpointing(RankStates(state))
    return state
