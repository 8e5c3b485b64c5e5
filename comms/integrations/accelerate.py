"""Accelerate: ``register(accelerator, model, spec, optimizer=opt, **options)`` — the commpress
hook on a prepared model, trained like ``comms.register(ddp, spec, optimizer=opt, **options)``.

``DistributedDataParallelKwargs(comm_hook=...)`` accepts only Accelerate's own enum hooks, so
a custom hook goes on the model that ``accelerator.prepare`` returned:

* multi-process DDP (``torch.compile`` looked through): :func:`comms.register` with every
  option it takes, paired with the prepared optimizer(s) as ``optimizer=opt`` does (SGD's
  momentum moves into the hook, the optimizer's goes to 0); gradient accumulation
  (``accelerator.accumulate``) works unchanged: the hook runs on the synchronizing micro-step;
* FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``): :func:`comms.fsdp.register`;
* one process (no DDP): a ``UserWarning`` and ``None``.

Options are validated before anything changes. With ``checkpoint=True`` every rank's state
goes into ``accelerator.save_state`` (through
:class:`~comms.integrations.rank_states.RankStates`; register before ``load_state``).
:func:`load_state` loads a checkpoint with or without commpress state (without: a WARNING,
the residuals restart from zero; ``accelerator.load_state`` itself refuses such a folder).

Example (``accelerate launch --multi_gpu --num_processes 2 train.py``; on CPU keep
``cpu=True``)::

    import torch
    from accelerate import Accelerator
    from comms.integrations.accelerate import load_state, register

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    state = register(accelerator, model, "topk:density=0.01", optimizer=opt, algorithm="allgather")
    g = torch.Generator().manual_seed(accelerator.process_index)
    for step in range(40):
        x = torch.randn(32, 64, generator=g)
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)))
            opt.step(); opt.zero_grad()
    accelerator.save_state("ckpt")          # every rank's commpress state included
    accelerator.wait_for_everyone()
    load_state(accelerator, "ckpt")
"""

from __future__ import annotations

import logging
import os
import re

import torch

from ..core.checkpoint import settle
from .pairing import find_ddp, register_model, repair_momentum, warn_no_state
from .rank_states import RankStates

__all__ = ["register", "find_ddp", "load_state"]

logger = logging.getLogger(__name__)

_CUSTOM = re.compile(r"^custom_checkpoint_\d+\.pkl$")


def _as_list(optimizer) -> list:
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def register(accelerator, model: torch.nn.Module, compressor, *, optimizer=None,
             checkpoint: bool = True, **options):
    """Register the commpress hook on the model ``accelerator.prepare`` returned.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: what ``accelerator.prepare`` returned for the model (DDP, possibly compiled; or
            an FSDP2 module).
        compressor: a :class:`compressors.Compressor` or a spec string.
        optimizer: the prepared optimizer (or a list of them) to pair with, as
            ``comms.register(..., optimizer=opt)``. ``None``: no pairing (``register`` then
            warns for error feedback without a known momentum).
        checkpoint: register the state with ``accelerator.register_for_checkpointing``.
        **options: as :func:`comms.register` (``algorithm``, ``momentum``, ``clip_norm``,
            ``warmup_steps``, ``timeout``, ``check_replicas_every``, ...); on FSDP2 what
            :func:`comms.fsdp.register` takes.

    Returns:
        The :class:`comms.CompressionState` (FSDP2: :class:`comms.fsdp.FSDPCompressionState`),
        or ``None`` on one process (with a ``UserWarning``).

    Raises:
        TypeError / ValueError: a bad spec or option (before anything changes), or several
            processes without DDP or FSDP2 (e.g. DeepSpeed, FSDP1).

    Example::

        >>> state = register(accelerator, model, "sign", optimizer=opt)
    """
    state = register_model(model, compressor, _as_list(optimizer), options,
                           world_size=accelerator.num_processes, framework="Accelerate",
                           fix="commpress needs Accelerate's multi-process DDP (MULTI_CPU/"
                               "MULTI_GPU) or an FSDP2 plugin (fsdp_version=2)")
    if state is not None and checkpoint:
        accelerator.register_for_checkpointing(RankStates(state))
        if not getattr(accelerator, "_commpress_hooked", False):
            accelerator.register_load_state_pre_hook(_warn_before_load(accelerator))
            accelerator._commpress_hooked = True
    return state


def _commpress_objects(accelerator) -> list[RankStates]:
    return [o for o in accelerator._custom_objects if isinstance(o, RankStates)]


def _missing(accelerator, input_dir) -> bool:
    """The folder holds fewer custom states than are registered, one short per commpress state."""
    found = [f for f in os.listdir(input_dir) if _CUSTOM.match(f)]
    ours = len(_commpress_objects(accelerator))
    return bool(ours) and len(found) == len(accelerator._custom_objects) - ours


def _warn_before_load(accelerator):
    def hook(models, input_dir):
        if _missing(accelerator, input_dir) and accelerator.is_main_process:
            warn_no_state(input_dir, _commpress_objects(accelerator)[0].state.compressor.spec())
            logger.warning("commpress: accelerator.load_state refuses a folder with fewer custom "
                           "states than registered; comms.integrations.accelerate.load_state "
                           "loads it")
    return hook


def load_state(accelerator, input_dir: str, **kwargs) -> None:
    """``accelerator.load_state(input_dir, **kwargs)`` that also loads a folder saved without
    commpress state (a plain-DDP run): a WARNING, and the residuals restart from zero.

    After loading, an optimizer that came back with momentum while the hook applies it is set
    to momentum 0 again (with a WARNING).
    """
    ours = _commpress_objects(accelerator)
    states = [o.state for o in ours]
    if ours and _missing(accelerator, input_dir):
        if accelerator.is_main_process:
            warn_no_state(input_dir, states[0].compressor.spec())
        for st in states:
            settle(st)  # reported: the first step's check stays quiet
        kept = list(accelerator._custom_objects)
        accelerator._custom_objects[:] = [o for o in kept if not isinstance(o, RankStates)]
        try:
            accelerator.load_state(input_dir, **kwargs)
        finally:
            accelerator._custom_objects[:] = kept
    else:
        accelerator.load_state(input_dir, **kwargs)
    for st in states:
        repair_momentum(st, accelerator._optimizers, input_dir)
