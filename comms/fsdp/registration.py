"""``register``: equip every FSDP2 module of a model with commpress (the package docstring
says what happens in FSDP and HSDP mode)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .reduce_scatter import CompressedReduceScatter
from ..outer.attach import attach_outer, check_outer_pairing, take_sync_options
from .bounded import BoundedReduceScatter, BoundedReplicateAllReduce
from .replicate import ReplicateAllReduce
from .params import PARAM_MODES, QuantizedAllGather
from .state import FSDP_CONFIG_FIELDS, FSDPCompressionState
from ..core.pairing import (ADAM_FREEZE_DEFAULT, adam_pairing, check_pairing, give_back_momentum,
                            pair_optimizer, replica_guard)

__all__ = ["register", "FSDPCompressionState", "CompressedReduceScatter", "ReplicateAllReduce",
           "QuantizedAllGather", "PARAM_MODES", "FSDP_CONFIG_FIELDS", "fsdp_modules"]

logger = logging.getLogger(__name__)


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(fqn, module)`` of every FSDP2 module of ``model`` that owns parameters, in
    ``named_modules`` order (the root's fqn is ``""``)."""
    out = []
    for fqn, m in model.named_modules():
        if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups:
            out.append((fqn, m))
    return out


def _is_fsdp1(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _check_model(model) -> None:
    """Raise naming a model commpress's FSDP support cannot equip at all."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"register() needs an nn.Module, got {type(model).__name__}")
    if _is_fsdp1(model):
        raise TypeError("commpress FSDP support needs FSDP2 (torch.distributed.fsdp.fully_shard); this model "
                        "holds an FSDP1 FullyShardedDataParallel: apply fully_shard (FSDP2) instead")


def _check_module(state: FSDPCompressionState, fqn: str, m, replicate_group) -> float:
    """Raise naming a module commpress cannot equip; return its post-sum divide factor."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    name = fqn or "<root>"
    groups = m._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError(f"FSDP module {name!r} has {len(groups)} parameter groups (per-parameter "
                         "meshes via shard_placement_fn); a custom reduce-scatter is ambiguous there")
    g = groups[0]
    if g._is_hsdp or type(g.mesh_info).__name__ != "FSDPMeshInfo":
        raise ValueError(f"FSDP module {name!r} is on a {type(g.mesh_info).__name__} (native 2-D HSDP "
                         "or replicate); shard it with fully_shard(mesh=mesh['shard']) and pass "
                         "replicate_group=mesh.get_group('replicate')")
    if isinstance(g._reduce_scatter_comm, (CompressedReduceScatter, BoundedReduceScatter)) or isinstance(
            g._all_reduce_hook, (ReplicateAllReduce, BoundedReplicateAllReduce)) or isinstance(g._all_gather_comm, QuantizedAllGather):
        raise ValueError(f"FSDP module {name!r} already has commpress registered")
    if state.mode == "fsdp" and type(g._reduce_scatter_comm) is not DefaultReduceScatter:
        raise ValueError(f"FSDP module {name!r} already has a custom reduce-scatter "
                         f"({type(g._reduce_scatter_comm).__name__})")
    if state.params != "full" and type(g._all_gather_comm) is not DefaultAllGather:
        raise ValueError(f"FSDP module {name!r} already has a custom all-gather "
                         f"({type(g._all_gather_comm).__name__}); pass params='full' to keep it")
    if state.mode == "hsdp" and g._all_reduce_hook is not None:
        raise ValueError(f"FSDP module {name!r} already has an all-reduce hook")
    shard = g.mesh_info.shard_mesh_size
    replicas = dist.get_world_size(replicate_group) if state.mode == "hsdp" else 1
    return float(g.gradient_divide_factor or shard * replicas)


def _checked_modules(model, probe: FSDPCompressionState, replicate_group):
    """The FSDP2 modules of ``model`` and their divide factors, every one checked."""
    mods = fsdp_modules(model)
    if not mods:
        raise TypeError(f"{type(model).__name__} has no FSDP2 module with parameters: apply "
                        "torch.distributed.fsdp.fully_shard first")
    return mods, [_check_module(probe, fqn, m, replicate_group) for fqn, m in mods]


def _attach(state, mods, factors, guard, optimizer, adam_freeze) -> None:
    """The state's modules, divide factors, replica guard and Adam's momentum space."""
    state.modules, state.divide_factors = [fqn for fqn, _ in mods], factors
    state.replica_guard = guard
    if getattr(state.compressor, "sparsifies", False):  # sign's shared momentum needs it gathered
        state.adam = adam_pairing(state, optimizer, adam_freeze, lambda: state.comm_for(None),
                                  lambda: max(state.steps.values(), default=0))


def _equip(state: FSDPCompressionState, mods) -> None:
    """Change the (validated) modules; every collective FSDP issues for them goes through
    commpress (bounded waits, named errors), except a custom all-gather or shard reduce-scatter
    of the user's, which is kept. The identity compressor with nothing to do locally keeps
    FSDP's own collectives and arithmetic (bitwise plain FSDP2 / native HSDP)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    for i, (fqn, m) in enumerate(mods):
        g = m._get_fsdp_state()._fsdp_param_groups[0]
        if type(g._all_gather_comm) is DefaultAllGather:
            m.set_custom_all_gather(QuantizedAllGather(state, i))
        own_rs = type(g._reduce_scatter_comm) is DefaultReduceScatter
        if state.native or state.outer is not None:
            if own_rs:  # the outer sync: each replica's shard group averages its own gradients
                m.set_custom_reduce_scatter(BoundedReduceScatter(state, i, counts=state.mode == "fsdp"
                                                                 or state.outer is not None))
            if state.mode == "hsdp" and state.outer is None:
                m.set_all_reduce_hook(BoundedReplicateAllReduce(state, i))
            continue
        m.set_force_sum_reduction_for_comms(True)  # sums everywhere; divided once, below
        # a parameter without a gradient stays in the reduce-scatter as zeros: the layout, and
        # so the residual and velocity of the module, survive steps that leave it unused; its
        # gradient is dropped again after backward, as plain FSDP2 leaves it (comms.fsdp.unused)
        # — unless the user asked FSDP2 for those zeros
        if not g.reduce_scatter_unused_params:
            m.set_reduce_scatter_unused_params(True, recurse=False)
            state.unused.track(state, i, g)
        if state.mode == "fsdp":
            # the reduce-scatter divides itself (FSDP's divide would read the output at once),
            # so its exchange may overlap the rest of backward
            m.set_gradient_divide_factor(1.0)
            m.set_custom_reduce_scatter(CompressedReduceScatter(state, i, module=m))
        else:
            if own_rs:
                m.set_custom_reduce_scatter(BoundedReduceScatter(state, i))
            if g.mesh_info.shard_mesh_size > 1:
                m.set_gradient_divide_factor(state.divide_factors[i])
                m.set_all_reduce_hook(ReplicateAllReduce(state, i))
            else:
                # one rank per shard group: FSDP would divide twice (its single-rank path divides
                # the copy by the factor and divides again after the hook), so the hook divides
                m.set_gradient_divide_factor(1.0)
                m.set_all_reduce_hook(ReplicateAllReduce(state, i, divide=state.divide_factors[i]))


def _register_outer(model, compressor, replicate_group, optimizer, adam_freeze, sync, check_every,
                    options) -> FSDPCompressionState:
    """HSDP with ``sync_every=H``: FSDP's own reduce-scatter inside each shard group every step
    (bounded), no replicate all-reduce; the local shards are synced across the replicate group
    every ``H`` steps by the outer sync (:mod:`comms.outer`)."""
    if replicate_group is None:
        raise ValueError("sync_every syncs replicas: it needs HSDP (pass replicate_group); FSDP2's "
                         "shards have no replica to sync with")
    check_outer_pairing(optimizer, adam_freeze, options, ADAM_FREEZE_DEFAULT)
    kw = {k: v for k, v in options.items() if k not in ("algorithm", "params")}
    state = FSDPCompressionState(compressor, replicate_group=replicate_group, params=options.get("params"),
                                 algorithm=options.get("algorithm"), **kw)  # every option validated
    mods, factors = _checked_modules(model, state, replicate_group)
    state.modules, state.divide_factors = [fqn for fqn, _ in mods], factors
    params = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters() if p.requires_grad]
    state.outer = attach_outer(params, state.comm_for(replicate_group), state.compressor, optimizer, sync,
                               check_every, options)
    _equip(state, mods)
    model._commpress_fsdp_state = state
    return state


def register(model: torch.nn.Module, compressor, *, replicate_group=None, algorithm: str | None = None,
             params: str | None = None, optimizer=None, check_replicas_every: int | None = None,
             adam_freeze=ADAM_FREEZE_DEFAULT,
             **options) -> FSDPCompressionState:
    """Equip every FSDP2 module of ``model`` with compressed gradient sync; return the state.

    Call after ``fully_shard`` and before the first backward, on every rank with the same
    arguments; everything is validated first. HSDP ``sync_every=H``: :mod:`comms.outer`.

    Args:
        model: the root module, after ``fully_shard`` was applied to it and/or its children.
        compressor: a :class:`compressors.Compressor` or a spec (``"topk:density=0.01"``).
        replicate_group: ``None``: FSDP mode. A ``ProcessGroup``: HSDP mode — ``model`` is 1-D
            ``fully_shard`` over the shard group; the shards are reduced across this group.
        algorithm: ``"auto"`` (``None``, the default): per module, dense or compressed by
            measured calls; compressed on every call: ``"scatter_reduce"`` (FSDP) or
            ``"allreduce"``, ``"allgather"``, ``"two_phase"`` (HSDP).
        params: the parameter all-gather (:mod:`comms.fsdp.params`): ``"auto"``, ``"full"``, ``"int8"``, ``"int4"``.
        optimizer, adam_freeze: paired as :func:`comms.register` does (:mod:`comms.core.pairing`).
        check_replicas_every: ``N`` > 0 compares parameters every ``N`` steps (HSDP: the
            replicas' shards; FSDP: the gathered parameters); ``None``/0: off.
        **options: :class:`~comms.core.options.PipelineOptions` (``start_iter`` default 0).

    Raises:
        TypeError: an FSDP1 model, no FSDP2 module, a bad option type.
        ValueError: an unsupported compressor or option; a module with several parameter
            groups, on native 2-D HSDP, or with a commpress or custom hook already.

    Example::

        >>> state = comms.fsdp.register(model, "sign", optimizer=opt)           # FSDP
        >>> state = comms.fsdp.register(model, "qsgd:bits=4",                   # HSDP
        ...                             replicate_group=mesh.get_group("replicate"))
    """
    _check_model(model)
    sync, _auto = take_sync_options(options)  # auto's outer sync: DDP only
    if sync is not None:  # HSDP, communicating every H steps across the replicas
        return _register_outer(model, compressor, replicate_group, optimizer, adam_freeze, sync,
                               check_replicas_every, dict(options, algorithm=algorithm, params=params))
    guard = replica_guard(model, check_replicas_every, gathered=replicate_group is None)
    probe = FSDPCompressionState(compressor, replicate_group=replicate_group, algorithm=algorithm,
                                 params=params, **options)  # every option validated first
    mods, factors = _checked_modules(model, probe, replicate_group)
    state, taken = pair_optimizer(optimizer, lambda **kw: FSDPCompressionState(
        compressor, replicate_group=replicate_group, algorithm=algorithm, params=params, **kw), options,
        check=lambda probe: check_pairing(probe, optimizer, adam_freeze, model.named_parameters(),
                                          sparsifiers_only=True))
    _attach(state, mods, factors, guard, optimizer, adam_freeze)
    try:
        _equip(state, mods)
    except Exception:
        give_back_momentum(optimizer, taken)
        if state.adam is not None:
            state.adam.remove()
        raise
    model._commpress_fsdp_state = state
    logger.info("commpress: %s on %d FSDP modules (%s, algorithm %s, params %s), error feedback %s",
                state.compressor.spec(), len(mods), state.mode, state.algorithm, state.params,
                state.error_feedback)
    return state
