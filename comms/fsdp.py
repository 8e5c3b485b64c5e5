"""Compressed gradient sync for FSDP2 (``fully_shard``) and HSDP: one call, :func:`register`.

Two modes, chosen by whether a replicate group is given:

* **FSDP** (``replicate_group=None``): every FSDP module's reduce-scatter becomes the
  scatter-reduce half of ``two_phase`` (:func:`comms.algorithms.two_phase.scatter_send` /
  :func:`~comms.algorithms.two_phase.decode_sum`): each rank compresses the chunk of its
  flat padded gradient that each destination owns, one ``all_to_all`` moves them, the owner
  decodes and sums them **in rank order** into its output shard. No second compression:
  the owner's sum is what FSDP keeps, so every rank of the group holds the bits it owns
  and nobody else recomputes them (ARCHITECTURE.md §5, "computed once"). Bytes sent per
  rank per module: ``(W - 1) * (P + 1)``, ``P`` one chunk's payload, 1 the flag byte.
* **HSDP** (``replicate_group`` given; the model is 1-D ``fully_shard`` over the *shard*
  group, e.g. ``mesh["shard"]`` of a ``(replicate, shard)`` mesh): FSDP's own
  full-precision reduce-scatter inside the shard group (fast intra-node links), then our
  compressed all-reduce of the output shard across the replicate group through
  ``set_all_reduce_hook`` with any flat algorithm (``allreduce``, ``allgather``,
  ``two_phase``) — "shard within a node, replicate across nodes".

The parameters (FSDP mode): FSDP2 moves them twice a step (the all-gathers before forward and
before backward) against the gradient once, so by default they travel block-quantized too
(``params``; :mod:`comms.fsdp_params`, ZeRO++'s qwZ): int8 codes with an fp32 scale per 256
elements, every rank decoding the same bytes — its own shard included — so every rank computes
with the same unsharded parameters; the fp32 shards the optimizer updates and a checkpoint
saves are untouched. ``params="auto"`` (the default) times full and int8 per module; HSDP's
all-gathers stay inside a host and the identity compressor stays bitwise plain FSDP2: full.

The owner's own chunk of the reduce-scatter never leaves it, so it is added exactly (never
encoded, no residual): the codec does ``(W - 1) / W`` of the whole gradient. Inside backward
the compressed reduce-scatter returns once its exchange is issued and the decode lands when
backward ends (an autograd final callback), so the exchange overlaps the rest of backward.

Averaging happens once: :func:`register` turns on ``set_force_sum_reduction_for_comms(True)``
so every collective sums; in FSDP mode the reduce-scatter divides by the module's divide
factor itself (``register`` sets FSDP's to 1: FSDP's divide would read the output at once);
in HSDP mode FSDP divides afterwards (``register`` sets ``set_gradient_divide_factor(shard x
replicate)`` unless the module has its own). A ``ReduceOp.AVG`` that reaches a direct call
anyway is honoured (divide by the group size after the rank-order sum); ``PREMUL_SUM`` is
refused.

Every option of :func:`comms.register` works here too (one
:class:`~comms.options.PipelineOptions`; the stages of :mod:`comms.pipeline`): ``optimizer=``
(SGD momentum taken over as momentum correction), ``warmup_steps``, ``residual_bound``,
``clip_norm``, ``timeout``, ``check_replicas_every`` (HSDP: the replicas' shards; FSDP: the
gathered parameters) and ``algorithm="auto"`` (per module, dense or compressed by measured
calls: :mod:`comms.fsdp_tuner`). Parameters without a gradient in a step (FSDP2 would leave
them out of the reduce-scatter and change its layout, losing the residual) are reduce-scattered
as zeros (``set_reduce_scatter_unused_params(True)``): a zero costs its compressed bytes, and
the residual survives. A reset that still happens is counted in ``report()`` and logged once.

Error feedback (on by default for biased compressors: top-k, random-k, sign, casts; off for
QSGD) keeps per rank and per module: in FSDP mode the residual of the **whole unsharded
padded gradient** (``W x shard`` elements: the memory of one full gradient of the model per
rank, in the reduce dtype — the price of compressing what every rank sends); in HSDP mode the
residual of the output shard only (``1/W`` of that) plus the algorithm's own store.
``error_feedback=False`` turns it off.

Non-finite guard: in FSDP mode every rank's flag rides its ``all_to_all`` payloads as one
byte, so all ranks learn it with no extra collective; in HSDP mode (and on dense calls that
keep per-rank memory) one 1-element allreduce per module runs next to the data. A flagged module's output is NaN on every rank
(``GradScaler`` skips the step) and its residual and store are zeroed. Neither reads the
flag on the host (``state.nonfinite_modules`` does, when asked).

Example::

    >>> from torch.distributed.fsdp import fully_shard
    >>> for block in model.blocks:
    ...     fully_shard(block)
    >>> fully_shard(model)
    >>> state = comms.fsdp.register(model, "qsgd:bits=4")   # before the first step
    >>> torch.save(state.state_dict(), f"comm.rank{rank}.pt")     # per rank
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .fsdp_comms import CompressedReduceScatter, ReplicateAllReduce, ShardReduceScatter
from .fsdp_params import PARAM_MODES, QuantizedAllGather
from .fsdp_state import FSDP_CONFIG_FIELDS, FSDPCompressionState
from .register import ADAM_FREEZE_DEFAULT, adam_pairing, check_pairing, give_back_momentum, pair_optimizer, replica_guard

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
    if isinstance(g._reduce_scatter_comm, (CompressedReduceScatter, ShardReduceScatter)) or isinstance(
            g._all_reduce_hook, ReplicateAllReduce) or isinstance(g._all_gather_comm, QuantizedAllGather):
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
    """Change the (validated) modules: sums everywhere, FSDP divides once afterwards; every
    collective FSDP issues for them goes through commpress (bounded waits, named errors),
    except a custom all-gather or shard reduce-scatter of the user's, which is kept."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    for i, (fqn, m) in enumerate(mods):
        g = m._get_fsdp_state()._fsdp_param_groups[0]
        m.set_force_sum_reduction_for_comms(True)
        # a parameter without a gradient stays in the reduce-scatter as zeros: the layout, and
        # so the residual and velocity of the module, survive steps that leave it unused; its
        # gradient is dropped again after backward, as plain FSDP2 leaves it (comms.fsdp_unused)
        # — unless the user asked FSDP2 for those zeros
        if not g.reduce_scatter_unused_params:
            m.set_reduce_scatter_unused_params(True, recurse=False)
            state.unused.track(state, i, g)
        if type(g._all_gather_comm) is DefaultAllGather:
            m.set_custom_all_gather(QuantizedAllGather(state, i))
        if state.mode == "fsdp":
            # the reduce-scatter divides itself (FSDP's divide would read the output at once),
            # so its exchange may overlap the rest of backward
            m.set_gradient_divide_factor(1.0)
            m.set_custom_reduce_scatter(CompressedReduceScatter(state, i, module=m))
        else:
            m.set_gradient_divide_factor(state.divide_factors[i])
            if type(g._reduce_scatter_comm) is DefaultReduceScatter:
                m.set_custom_reduce_scatter(ShardReduceScatter(state, i))
            m.set_all_reduce_hook(ReplicateAllReduce(state, i))


def register(model: torch.nn.Module, compressor, *, replicate_group=None, algorithm: str | None = None,
             params: str | None = None, optimizer=None, check_replicas_every: int | None = None,
             adam_freeze=ADAM_FREEZE_DEFAULT,
             **options) -> FSDPCompressionState:
    """Equip every FSDP2 module of ``model`` with compressed gradient sync; return the state.

    Call after ``fully_shard`` and before the first backward, on every rank with the same
    arguments; everything is validated before anything changes. Returns the state.

    Args:
        model: the root module, after ``fully_shard`` was applied to it and/or its children.
        compressor: a :class:`compressors.Compressor` or a spec (``"topk:density=0.01"``).
        replicate_group: ``None``: FSDP mode (compressed reduce-scatter). A
            ``ProcessGroup``: HSDP mode — ``model`` must be 1-D ``fully_shard`` over the
            shard group, and the gradient shards are all-reduced, compressed, across this
            group (see the module docstring).
        algorithm: ``"auto"`` (``None``, the default): per module, dense or compressed by
            measured calls. Compressed on every call: ``"scatter_reduce"`` (FSDP) or
            ``"allreduce"``, ``"allgather"``, ``"two_phase"`` (HSDP).
        params: the parameter all-gather (:mod:`comms.fsdp_params`; the fp32 shards the
            optimizer updates are untouched): ``"int8"`` / ``"int4"`` — block-quantized
            (256 elements per fp32 scale), every rank decodes the same bytes; ``"full"`` —
            FSDP's own; ``"auto"`` (``None``, the default) — FSDP mode with a lossy
            compressor: full or int8 per module by measured calls (int8 on every call with
            a pinned ``algorithm``); HSDP or ``"identity"``: full.
        optimizer: paired as :func:`comms.register` does (SGD momentum taken over; Adam(W)
            with top-k/random-k in momentum space, a velocity per rank from 0 at the freeze).
        adam_freeze: as in :func:`comms.register`.
        check_replicas_every: ``N`` > 0 compares parameters every ``N`` steps (HSDP: the
            replicas' shards; FSDP: the gathered parameters); ``None``/0: off.
        **options: :class:`~comms.options.PipelineOptions` (``error_feedback``, ``seed``,
            ``start_iter`` — default 0 —, ``timeout``, ``momentum``, ``momentum_masking``,
            ``clip_norm``, ``residual_bound``, ``warmup_steps``).

    Raises:
        TypeError: an FSDP1 model, no FSDP2 module, a bad option type.
        ValueError: an unsupported compressor or option; a module with several parameter
            groups, on native 2-D HSDP, or with a commpress or custom comm hook already.

    Example::

        >>> state = comms.fsdp.register(model, "sign", optimizer=opt)           # FSDP
        >>> state = comms.fsdp.register(model, "qsgd:bits=4",                   # HSDP
        ...                             replicate_group=mesh.get_group("replicate"))
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"register() needs an nn.Module, got {type(model).__name__}")
    if _is_fsdp1(model):
        raise TypeError("commpress FSDP support needs FSDP2 (torch.distributed.fsdp.fully_shard); this model "
                        "holds an FSDP1 FullyShardedDataParallel: apply fully_shard (FSDP2) instead")
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
