"""Fabric: ``register(fabric, model, spec, optimizer=opt, **options)`` — the commpress hook on
the model ``fabric.setup`` returned, trained like ``comms.register(ddp, spec, optimizer=opt,
**options)``.

Fabric has no hook argument. This helper finds the ``DistributedDataParallel`` inside the
``_FabricModule`` (``Fabric(strategy="ddp")``, ``"ddp_spawn"``, ...; ``torch.compile`` looked
through), registers :func:`comms.register` there with every option it takes and pairs it with
the optimizer(s) as ``optimizer=opt`` does (SGD's momentum moves into the hook, the
optimizer's goes to 0). A ``fully_shard`` (FSDP2) model goes to :func:`comms.fsdp.register`.
One process: a ``UserWarning`` and ``None``. Another strategy (FSDP1, DeepSpeed, DP): a
``TypeError`` saying what to use. ``fabric.no_backward_sync`` (gradient accumulation) works
unchanged.

Checkpoints: put ``RankStates(state)`` in the state given to ``fabric.save`` (it gathers
every rank's residuals; ``fabric.save`` runs on every rank) and load with :func:`load`, which
also accepts a checkpoint without it (a WARNING: the residuals restart from zero).

Example (``python train.py``: Fabric starts rank 1 by running the file again)::

    import torch
    from lightning.fabric import Fabric
    from comms.integrations.fabric import RankStates, load, register

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    state = register(fabric, model, "topk:density=0.01", optimizer=opt, algorithm="allgather")
    g = torch.Generator().manual_seed(fabric.global_rank)
    for step in range(20):
        for micro in range(2):  # 2-step gradient accumulation
            x = torch.randn(32, 64, generator=g)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)) / 2)
        opt.step(); opt.zero_grad()
    ckpt = {"model": model, "optimizer": opt, "commpress": RankStates(state)}
    fabric.save("fabric.ckpt", ckpt)
    load(fabric, "fabric.ckpt", ckpt)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..core.checkpoint import settle
from .pairing import register_model, repair_momentum, warn_no_state
from .rank_states import RankStates

__all__ = ["register", "load", "RankStates"]

logger = logging.getLogger(__name__)


def register(fabric, model: torch.nn.Module, compressor, *, optimizer=None, **options):
    """Register the commpress hook on the model ``fabric.setup`` returned.

    Args:
        fabric: the ``lightning.fabric.Fabric``.
        model: what ``fabric.setup`` / ``setup_module`` returned (or the module inside it).
        compressor: a :class:`compressors.Compressor` or a spec string.
        optimizer: the (set-up) optimizer, or a list of them, to pair with as
            ``comms.register(..., optimizer=opt)``. ``None``: no pairing.
        **options: as :func:`comms.register` (``algorithm``, ``momentum``, ``clip_norm``,
            ``warmup_steps``, ``timeout``, ``check_replicas_every``, ...); on FSDP2 what
            :func:`comms.fsdp.register` takes.

    Returns:
        The :class:`comms.CompressionState` (FSDP2: :class:`comms.fsdp.FSDPCompressionState`),
        or ``None`` on one process (with a ``UserWarning``).

    Raises:
        TypeError / ValueError: a bad spec or option (before anything changes), or several
            processes with a strategy that wraps neither in DDP nor with ``fully_shard``.
    """
    opts = [] if optimizer is None else \
        list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return register_model(model, compressor, opts, options, world_size=fabric.world_size,
                          framework="Fabric",
                          fix=f"Fabric(strategy={type(fabric.strategy).__name__}) does not wrap the "
                              "model in DistributedDataParallel; use Fabric(strategy='ddp') (or "
                              "'ddp_spawn'), or for sharding ModelParallelStrategy with fully_shard "
                              "(FSDP2, comms.fsdp.register)")


def load(fabric, path, state: dict[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """``fabric.load(path, state, strict=strict)`` that accepts a checkpoint without the
    :class:`RankStates` entries of ``state`` (a WARNING: the residuals restart from zero).

    Optimizers in ``state`` that come back with momentum while the hook applies it are set to
    momentum 0 again (a WARNING). Returns what ``fabric.load`` returns (the unused entries).
    """
    ours = {k: v for k, v in state.items() if isinstance(v, RankStates)}
    rest = {k: v for k, v in state.items() if k not in ours}
    remainder = fabric.load(path, rest, strict=strict)
    state.update(rest)  # fabric.load replaces plain values in the dict it was given
    for key, entry in ours.items():
        if key in remainder:
            entry.load_state_dict(remainder.pop(key))
        elif fabric.global_rank == 0:
            warn_no_state(path, entry.state.compressor.spec(), [entry.state])
        else:
            settle(entry.state)  # reported by rank 0
    optimizers = [v for v in rest.values() if hasattr(v, "param_groups")]
    for entry in ours.values():
        repair_momentum(entry.state, optimizers, str(path))
    return remainder
