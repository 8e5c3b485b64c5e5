"""``compression_hook``: the DDP communication hook that compresses each gradient bucket.

Per bucket: configuration check (once per layout, :mod:`comms.config_check`), plain
allreduce for the first ``start_iter`` iterations, then divide by the world size, add the
error-feedback residual, run the bucket's algorithm (fixed, or chosen by the ``auto``
planner), update the residual and write the aggregate into ``bucket.buffer()``. The future
DDP gets resolves after the step's non-finite flags (:mod:`comms.step_flags`); bucket
layouts for resume are tracked by :mod:`comms.layouts`. Guarantees are listed in README
"Troubleshooting and guarantees"; the invariants in ``comms/ARCHITECTURE.md`` §4-5.
"""


import functools
import logging
import struct

import torch
import torch.distributed as dist

from compressors import Context
from compressors.deferred import Deferred, materialized

from .algorithms import ALGORITHMS, DENSE, get_algorithm
from .deadline import clean_message, failure
from .errors import where
from .futures import completed, guarded, stream_mark, wait_mark, when_all
from .state import CompressionState
from .stats import dense_wire_bytes, record_call

__all__ = ["compression_hook", "dense_allreduce", "RESIDUAL_DRAIN_STEPS"]

logger = logging.getLogger(__name__)

#: dense steps over which a bucket's error-feedback residual is added once plain allreduce is
#: the decision for it (a dense lock; trial and watchdog dense steps leave the residual for
#: the compressed steps that follow): random-k 1%'s residual holds up to 5 steps of gradient
#: (its residual bound; 10 until session 24), so each of 8 shares adds under a step; added at
#: once, or at every trial/watchdog switch, it was a 10x step (bound 10: loss 0.5 -> 44-113,
#: bench/results)
RESIDUAL_DRAIN_STEPS = 8


def dense_allreduce(state: CompressionState, buf: torch.Tensor) -> torch.futures.Future:
    """Plain averaged allreduce of ``buf`` in place (DDP's default behaviour)."""
    comm = state.comm()
    buf.div_(comm.world_size)  # divide first, as torch's hooks do, to avoid fp16 overflow
    return comm.all_reduce(buf)


#: a warm-up variant that keeps more than this fraction of the elements goes dense: on CPU its
#: selection and decodes cost more than a dense step (the 25M MLP at 1 Gb/s: a 22% top-k step
#: 2.15 s, a dense one 0.96 s, a 10% one 0.54 s; s22, bench/results/convergence_topk_warmup5_s22.md)
WARM_DENSE_DENSITY = 0.15


def _warm_step_goes_dense(alg, compressor, x: torch.Tensor, world: int) -> bool:
    """A warm-up step sends the bucket dense when its mild variant keeps more than
    :data:`WARM_DENSE_DENSITY` of the elements or would send more than half a dense step's
    bytes (top-k's allgather at many ranks: ``(world - 1) * 8 d n`` bytes); the quality the
    ramp buys comes from its first, near-dense steps, which a dense step gives as well."""
    if getattr(compressor, "density", 0.0) > WARM_DENSE_DENSITY:
        return True
    return 2 * alg.wire_bytes(compressor, x.numel(), x.dtype, world) > \
        dense_wire_bytes(x.numel(), x.element_size(), world)


def _flush_residual_(x, store: dict, prev: str | None, comm) -> None:
    """On a switch away from ``prev``: its kept residual goes into ``x`` once."""
    alg = ALGORITHMS.get(prev) if prev is not None else None
    if alg is not None:
        alg.flush_residual_(x, store, comm)


def _on_nonfinite(state: CompressionState):
    def reset(bucket: int, step: int) -> None:
        state.reset_bucket(bucket)
        state.nonfinite_buckets += 1
        msg = ("commpress: non-finite gradient in bucket %d at step %d: the bucket is NaN on "
               "every rank (GradScaler skips the step) and its error-feedback residual and "
               "algorithm store were reset (state.nonfinite_buckets counts these)")
        if not state._warned_nonfinite:
            state._warned_nonfinite = True
            logger.warning(msg + "; logged once", bucket, step)
        else:
            logger.debug(msg, bucket, step)
    return reset


def _dense_for_now(state: CompressionState) -> bool:
    """This dense step is an autotune trial's or a watchdog check's: the decision may be to
    compress (the same on every rank: the tuner's schedule is)."""
    tuner = getattr(state.planner, "tuner", None) if state.planner is not None else None
    return tuner is not None and (not tuner.locked or tuner.rule != tuner.decision)


def _local_(state: CompressionState, index: int, x: torch.Tensor, div: int = 1) -> None:
    """This rank's share of the average, ``x / div`` (``div``: the world size), then DGC's
    local steps on it, in place: clip the bucket's norm to ``clip_norm / world``, then
    momentum correction (``x <- u = m u + x``; with the division in one pass). Private
    arithmetic before any collective; no host sync (the clip factor stays a tensor)."""
    if state.clip_norm is not None:
        if div != 1:
            x.div_(div)
            div = 1
        limit = state.clip_norm / state.comm().world_size
        norm = torch.linalg.vector_norm(x, dtype=torch.float32)
        x.mul_(torch.clamp(limit / (norm + 1e-12), max=1.0).to(x.dtype))
    if state.momentum is not None:
        state.memory.momentum_(index, x, state.momentum, div)
    elif div != 1:
        x.div_(div)


def _local_flagged(state: CompressionState, index: int, x: torch.Tensor, world: int) -> torch.Tensor:
    """:func:`_local_` on a dense step, then the bucket's non-finite flag (a tensor: no host
    sync): a NaN that entered the velocity must reset it like a compressed step's would, or
    every later step stays NaN (GradScaler would skip them all). From the max ``|x|`` the
    compiled momentum pass saw when it ran, else one sum over the bucket."""
    state.memory.last_amax = None
    _local_(state, index, x, world)
    return _nonfinite_flag(x, state.memory.last_amax)


def _nonfinite_flag(x: torch.Tensor, amax: int | None) -> torch.Tensor:
    """The bucket's flag for the step's flag allreduce (a tensor, not a bool: no host sync):
    NaN/Inf anywhere, or a finite bucket whose sum may overflow fp32 — from ``amax``, the max
    ``|x|`` a compiled pass that wrote x saw (no extra pass), else a plain sum (no float64
    copy of the bucket; fp16 sums would overflow at 65504)."""
    if amax is not None:
        return torch.tensor(_nonfinite_or_overflows(amax, x.numel()))
    return ~torch.isfinite(x.sum(dtype=torch.float32))


def _plain_allreduce(state: CompressionState, comm, index: int, step: int, x: torch.Tensor, flag,
                     scatter, label: str = "dense allreduce") -> torch.futures.Future:
    """A dense step of ``x`` (already this rank's share: summed, not averaged) through the
    step's flags; counted in ``state.dense_calls``."""
    state.dense_calls += 1
    what = where(comm, label, index, x.numel(), x.dtype, step)
    return state.flags.enqueue(index, step, flag, x, guarded(comm.all_reduce(x), what), scatter, what=what)


def _averaged_allreduce(state: CompressionState, comm, index: int, step: int, x: torch.Tensor,
                        scatter=None) -> torch.futures.Future:
    """DDP's plain step for a bucket with no local steps: ``x`` divided by the world size
    first (as torch's hooks do: no fp16 overflow in the sum), then :func:`_plain_allreduce`
    without a flag of its own."""
    x.div_(comm.world_size)
    return _plain_allreduce(state, comm, index, step, x, None, scatter)


def _compress_flat(state: CompressionState, x: torch.Tensor, index: int, step: int,
                   scatter=None, shapes: tuple = (), dense: bool = False) -> torch.futures.Future:
    """EF + compress + aggregate one flat tensor in place; returns the (pending) future.

    ``shapes``: the shapes of the parameters ``x`` is made of, in order (``()``: unknown);
    they reach the compressor as ``Context.shapes`` (PowerSGD factorizes each matrix).
    ``dense``: a plain allreduce step (before ``start_iter``, small buckets) that still needs
    the local steps (momentum correction, clipping).
    """
    comm = state.comm()
    world = comm.world_size
    compressor = state.compressor
    if dense:
        return _plain_allreduce(state, comm, index, step, x, _local_flagged(state, index, x, world),
                                scatter)
    name = state.algorithm_for(index, x.numel(), x.dtype)
    # the auto planner may move a bucket between algorithms (autotune trials): residuals of
    # the old one are added into the bucket once, so no gradient mass is lost
    prev = state.planner.note_used(index, name) if state.planner is not None else None
    switched = prev is not None and prev != name
    if name == DENSE:  # the auto planner routes this bucket to the plain allreduce
        record_call(state.stats, index, x.numel(), x.dtype, x.element_size(), world, DENSE, None)
        kept = state.error_feedback and index in state.memory.residuals
        if not switched and not kept and not state.local_transform:
            return _averaged_allreduce(state, comm, index, step, x, scatter)
        flag = _local_flagged(state, index, x, world)
        if switched:
            _flush_residual_(x, state.algo_store.get(index, {}), prev, comm)
            state.algo_store.pop(index, None)  # the store is spent; the velocity is not
        # the residual waits through a trial's or the watchdog's dense steps (compression comes
        # back); once dense is the decision it goes out in equal shares over a few dense steps
        if kept and not _dense_for_now(state):
            if index not in state.memory.draining:
                state.memory.start_drain(index, RESIDUAL_DRAIN_STEPS)
            state.memory.drain_step_(index, x)
        return _plain_allreduce(state, comm, index, step, x, flag, scatter)
    alg = get_algorithm(name)
    state.memory.draining.pop(index, None)  # back to compressing: what is left is a residual again
    compressor = state.compressor_at(step)  # warm-up variant (DGC) or the compressor itself
    bound = state.residual_bound
    # the division, momentum correction and the residual, written into x once (same bits as
    # in turn)
    fused = state.error_feedback and bound is None and state.clip_norm is None
    state.memory.last_amax = None
    if fused and state.momentum is not None:
        state.memory.momentum_residual_(index, x, state.momentum, world)
    elif fused:  # the division and the residual in one pass
        state.memory.div_residual_(index, x, world)
    else:
        _local_(state, index, x, world)
    if state.error_feedback and not fused:
        if bound is None:
            state.memory.add_residual_(index, x)
        else:  # x + r scaled down to at most bound * |x|: mass beyond it is dropped
            fresh = torch.linalg.vector_norm(x, dtype=torch.float32)
            state.memory.add_residual_(index, x)
            total = torch.linalg.vector_norm(x, dtype=torch.float32)
            x.mul_(torch.clamp(bound * fresh / (total + 1e-30), max=1.0).to(x.dtype))
    if switched:
        _flush_residual_(x, state.algo_store.get(index, {}), prev, comm)
        state.algo_store.pop(index, None)  # stores belong to one algorithm
    # it travels with the step's flag allreduce; the compiled pass's max |x| when it wrote x
    flag = _nonfinite_flag(x, state.memory.last_amax if fused and not switched else None)
    if compressor is not state.compressor and _warm_step_goes_dense(alg, compressor, x, world):
        # the lossless end of the ramp: the residual (already in x) goes with it; the velocity
        # goes on; flagged like a compressed step (a NaN resets the bucket's memory)
        state.memory.residuals.pop(index, None)
        record_call(state.stats, index, x.numel(), x.dtype, x.element_size(), world, DENSE, None)
        return _plain_allreduce(state, comm, index, step, x, flag, scatter, "dense allreduce (warm-up)")
    ctx = Context(numel=x.numel(), dtype=x.dtype, device=x.device, step=step,
                  bucket=index, rank=comm.rank, seed=state.seed, shapes=shapes)
    record_call(state.stats, index, x.numel(), x.dtype, x.element_size(), world, alg.name,
                lambda: alg.bucket_wire_bytes(compressor, ctx, world), compressor)
    what = where(comm, f"{alg.name} collective", index, x.numel(), x.dtype, step)
    masking = state.momentum_masking if state.momentum is not None and getattr(
        compressor, "sparsifies", False) else "off"
    mask = masking == "sent"  # DGC: wherever this rank sent
    # a sparsifier with error feedback on an algorithm that compresses again after the sum:
    # what the second compression leaves out of this rank's values stays in this rank's
    # residual (no owner residual), as if unsent — its momentum goes on like an unsent one's
    give_back = alg.holds_back and state.error_feedback and getattr(compressor, "sparsifies", False)
    # "held": where the aggregate left out what this rank sent (only algorithms that compress
    # again after the sum can); elsewhere every sent value landed and momentum goes on
    mask_held = masking == "held" and alg.holds_back and not give_back
    try:
        # deferred: decodes written straight into the residual and x (see finish); own: this
        # rank's decoded part is needed only for the residual and the masks
        kw = {"deferred": True, "own": bool(state.error_feedback or mask or mask_held)} \
            if alg.deferred_results else {}
        if give_back:
            kw["return_held"] = True
        elif kw and state.error_feedback and not (mask or mask_held):
            # the residual x - own, written while the payload is on the wire (x is unchanged
            # until finish writes the aggregate into it); own then comes back None
            kw["on_own"] = functools.partial(state.memory.update_, index, x)
        fut = alg(comm, compressor, x, ctx, state.store(index), **kw)
    except (RuntimeError, IndexError, OverflowError) as exc:
        # an intermediate round (waited in this thread) failed, or what it handed back does not
        # decode: gloo can return garbage instead of an error once a peer is gone. Raised from
        # here it would reach backward() bare ("index out of range in self")
        raise _round_failure(what, exc) from None
    # CUDA: what this thread enqueued while the payload is on the wire (on_own's residual, the
    # own decode) must finish before the callback, on another stream, writes into x
    in_flight = stream_mark(x)

    def finish(f):
        try:
            total, own = f.value()
        except Exception as exc:  # noqa: BLE001 - re-raised with context (cleaned at the last hop)
            msg = clean_message(exc)
            raise RuntimeError(msg if msg.startswith("commpress:") else f"{what} failed: {msg}") from exc
        wait_mark(in_flight, x)
        if give_back:  # before the aggregate goes into x
            own, total = materialized(own), materialized(total)
            if mask:
                state.memory.mask_velocity_(index, own)
            state.memory.update_returned_(index, x, own, total)
        elif mask or mask_held:  # before the aggregate goes into x
            own = materialized(own)
            held = None
            if mask_held:
                held = total = materialized(total)
            if state.error_feedback:  # residual and masking in one pass
                state.memory.update_masked_(index, x, own, held)
            else:
                state.memory.mask_velocity_(index, own, held)
        elif state.error_feedback and isinstance(own, Deferred) and isinstance(total, Deferred):
            return state.memory.update_into_(index, x, own, total)  # x read once, written once
        elif state.error_feedback and own is not None:  # None: written already (on_own)
            state.memory.update_(index, x, own)  # a Deferred own: x - own in one pass
        if isinstance(total, Deferred):
            total.into_(x)  # decoded straight into the bucket (after the residual read x)
        else:
            x.copy_(total)
        return x

    return state.flags.enqueue(index, step, flag, x, fut.then(finish), scatter, what=what)


_FP32_MAX = 3.4028234663852886e38


def _nonfinite_or_overflows(amax_bits: int, n: int) -> bool:
    """The hook's flag from the largest ``|x|`` (its fp32 bits): NaN or inf in the bucket, or
    ``n * max|x|`` beyond fp32's range (a sum that could overflow; the torch path's check is
    ``~isfinite(x.sum())``, which flags a subset of those)."""
    if amax_bits >= 0x7F800000:
        return True
    return struct.unpack("<f", struct.pack("<I", amax_bits))[0] * n > _FP32_MAX


def _round_failure(what: str, exc: BaseException) -> BaseException:
    """The error ``backward()`` gets when an algorithm fails in the hook's own thread."""
    if clean_message(exc).startswith("commpress:"):
        return failure(what, exc)  # our own wording (a timed-out round, a corrupt table)
    return failure(what, RuntimeError(
        f"{clean_message(exc)} (when a peer died or disconnected, gloo can hand back garbage "
        "instead of an error, and decoding it fails like this)"))


def _layout_plan(state: CompressionState, bucket: dist.GradBucket, buf: torch.Tensor, index: int):
    params = bucket.parameters()
    return state.layout_tracker.plan(index, [state.param_key(p) for p in params],
                                     [p.numel() for p in params], buf,
                                     [state.memory.residuals, state.memory.velocities],
                                     state.reset_bucket, state.error_feedback or state.local_transform)


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket over the group with compression and error feedback.

    The first ``state.start_iter`` iterations use plain allreduce. Afterwards the bucket is
    divided by the world size, its residual added, compressed, moved with the algorithm
    :meth:`~comms.state.CompressionState.algorithm_for` picks, decoded identically on every
    rank and written back into ``bucket.buffer()``.

    Args:
        state: a :class:`~comms.state.CompressionState`.
        bucket: DDP's gradient bucket.

    Returns:
        A future whose value is ``bucket.buffer()`` holding the averaged gradient.

    Raises:
        TypeError: the bucket is not floating point (before any communication).
        ValueError: the ranks' configurations differ (on every rank, before the data moves).

    Example::

        >>> state = comms.CompressionState("topk:density=0.01")
        >>> ddp_model.register_comm_hook(state, comms.compression_hook)

    .. warning::
        Residuals are per rank and per bucket layout: save ``state.state_dict()`` on every
        rank to resume bit-exactly. A non-finite gradient turns the whole bucket NaN on every
        rank (plain allreduce turns only the affected elements NaN).
    """
    buf = bucket.buffer()
    index = bucket.index()
    if not buf.is_floating_point():
        raise TypeError(f"commpress: bucket {index} has dtype {buf.dtype}; gradients must be "
                        "floating point")
    step = state.iter
    last = bucket.is_last()
    if last:
        state.iter += 1
    comm = state.comm()
    if state.planner is not None and comm.world_size > 1:
        if not state.planner.ready:
            # first call: every rank is here and nothing is in flight — discover the topology,
            # build its groups and probe the links (collective), once
            state.communicator = state.planner.setup(comm, state.process_group)
            comm = state.comm()
        if index == 0:  # DDP launches bucket 0 first, after the last step's futures were waited
            state.planner.begin_step(step, state.start_iter, buf.numel(), buf.dtype,
                                     state.warmup_steps)
        state.planner.observe(index, buf.numel(), buf.dtype, bucket)
    if index == 0 and state.replica_guard is not None and comm.world_size > 1:
        state.replica_guard.maybe_check(step, comm)  # raises on every rank at a mismatch
    if comm.world_size == 1 or buf.numel() == 0:
        if state.local_transform and buf.numel():
            _local_(state, index, buf)  # the momentum the optimizer no longer applies
        fut = completed(buf)  # nothing to exchange: the average of one is itself
    else:
        state.flags.drop_stale(step)
        state.config_check.check(comm, index, buf, step,
                                 lambda: state.config_hash(index, buf.numel(), buf.dtype, step),
                                 lambda: state.config_values(index, buf.numel(), buf.dtype, step))
        dense = step < state.start_iter or buf.numel() < state.min_compress_numel
        if dense and not state.local_transform:
            fut = _averaged_allreduce(state, comm, index, step, buf)
        else:
            plan = _layout_plan(state, bucket, buf, index)
            params = bucket.parameters()
            shape_at, off = {}, 0  # buffer offset -> parameter shape
            for p in params:
                shape_at[off] = (p.numel(), tuple(p.shape))
                off += p.numel()
            if off != buf.numel():
                shape_at = {}  # a layout we do not understand: shapes unknown
            if plan == [(index, None)]:
                shapes = tuple(s for _, s in shape_at.values())
                fut = _compress_flat(state, buf, index, step, shapes=shapes, dense=dense)
            else:
                subs = []
                for j, segs in plan:
                    x = torch.cat([buf[o: o + n] for o, n in segs])

                    def scatter(y, segs=segs):
                        pos = 0
                        for o, n in segs:
                            buf[o: o + n].copy_(y[pos: pos + n])
                            pos += n

                    segs_shapes = [shape_at.get(o) for o, _ in segs]
                    shapes = () if any(s is None or s[0] != n for s, (_, n) in zip(segs_shapes, segs)) \
                        else tuple(s[1] for s in segs_shapes)
                    subs.append(_compress_flat(state, x, j, step, scatter, shapes=shapes, dense=dense))
                fut = when_all(subs, buf)
    if last:
        state.flags.flush(comm, step, _on_nonfinite(state))
        state.layout_tracker.end_step()
    return fut
