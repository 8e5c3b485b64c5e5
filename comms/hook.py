"""``compression_hook``: the DDP communication hook that compresses each gradient bucket.

Per bucket: configuration check (once per layout, :mod:`comms.config_check`), plain
allreduce for the first ``start_iter`` iterations, then divide by the world size, add the
error-feedback residual, run the bucket's algorithm (fixed, or chosen by the ``auto``
planner), update the residual and write the aggregate into ``bucket.buffer()``. The future
DDP gets resolves after the step's non-finite flags (:mod:`comms.step_flags`); bucket
layouts for resume are tracked by :mod:`comms.layouts`. Guarantees are listed in README
"Troubleshooting and guarantees"; the invariants in ``comms/ARCHITECTURE.md`` §4-5.
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects
import logging

import torch
import torch.distributed as dist

from compressors import Context

from .algorithms import ALGORITHMS, DENSE, get_algorithm
from .deadline import clean_message, failure
from .errors import where
from .futures import completed, guarded, stream_mark, wait_mark, when_all
from .pipeline import (WARM_DENSE_DENSITY, Delivery, feed_, local_, local_flagged, nonfinite_flag, settle_,
                       warm_step_goes_dense)
from .state import CompressionState
from .stats import dense_wire_bytes, record_call

__all__ = ["compression_hook", "dense_allreduce", "RESIDUAL_DRAIN_STEPS", "WARM_DENSE_DENSITY"]

logger = logging.getLogger(__name__)

#: dense steps over which a bucket's error-feedback residual is added once plain allreduce is
#: the decision for it (a dense lock; trial and watchdog dense steps leave the residual for
#: the compressed steps that follow): random-k 1%'s residual holds up to 5 steps of gradient
#: (its residual bound), so each of 8 shares adds under a step; added at once it was a 10x
#: step (docs/design-notes.md, "Residual drain")
RESIDUAL_DRAIN_STEPS = 8


def dense_allreduce(state: CompressionState, buf: torch.Tensor) -> torch.futures.Future:
    """Plain averaged allreduce of ``buf`` in place (DDP's default behaviour)."""
    comm = state.comm()
    buf.div_(comm.world_size)  # divide first, as torch's hooks do, to avoid fp16 overflow
    return comm.all_reduce(buf)


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


def _limit(state: CompressionState, world: int) -> float | None:
    """The clip limit of one rank's share of the average (``clip_norm / world``)."""
    return None if state.clip_norm is None else state.clip_norm / world


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


def _record(state, index: int, x: torch.Tensor, world: int, name: str, wire=None, compressor=None):
    record_call(state.stats, index, x.numel(), x.dtype, x.element_size(), world, name, wire, compressor)


def _route_dense(state: CompressionState, comm, x: torch.Tensor, index: int, step: int, scatter,
                 prev: str | None, switched: bool) -> torch.futures.Future:
    """The auto planner routes this bucket to the plain allreduce: local steps, the previous
    algorithm's residual flushed once, the error-feedback residual kept through a trial's
    dense steps or drained over a few dense steps once dense is the decision.

    Under Adam's momentum space the gradient goes (AdamW's own step, :mod:`comms.adam`); at a
    dense lock what compression had not delivered yet (in the momentum space's coordinates)
    is dropped, not drained: a drained burst would enter Adam's variance."""
    world = comm.world_size
    _record(state, index, x, world, DENSE)
    kept = state.error_feedback and index in state.memory.residuals
    if state.adam is not None and (switched or (kept and not _dense_for_now(state))):
        if not _dense_for_now(state):
            state.memory.reset(index)
        state.algo_store.pop(index, None)
        switched, kept = False, False
    if not switched and not kept and not state.local_transform:
        return _averaged_allreduce(state, comm, index, step, x, scatter)
    flag = local_flagged(state, index, x, world, _limit(state, world))
    if switched:
        _flush_residual_(x, state.algo_store.get(index, {}), prev, comm)
        state.algo_store.pop(index, None)  # the store is spent; the velocity is not
    if kept and not _dense_for_now(state):
        if index not in state.memory.draining:
            state.memory.start_drain(index, RESIDUAL_DRAIN_STEPS)
        state.memory.drain_step_(index, x)
    return _plain_allreduce(state, comm, index, step, x, flag, scatter)


def _warm_step_goes_dense(alg, compressor, x: torch.Tensor, world: int) -> bool:
    """:func:`~comms.pipeline.warm_step_goes_dense` for ``alg``'s bytes against a dense
    allreduce's."""
    return warm_step_goes_dense(compressor, alg.wire_bytes(compressor, x.numel(), x.dtype, world),
                                dense_wire_bytes(x.numel(), x.element_size(), world))


def _compress_flat(state: CompressionState, x: torch.Tensor, index: int, step: int,
                   scatter=None, shapes: tuple = (), dense: bool = False, mbar=None,
                   params=()) -> torch.futures.Future:
    """One flat tensor through the pipeline in place; returns the (pending) future.

    ``shapes``: the shapes of the parameters ``x`` is made of, in order (``()``: unknown);
    they reach the compressor as ``Context.shapes`` (PowerSGD factorizes each matrix).
    ``dense``: a plain allreduce step (before ``start_iter``, small buckets) that still needs
    the local steps (momentum correction, clipping). ``mbar``: Adam's shared momentum of these
    elements once the variance froze (the momentum is what travels: :mod:`comms.adam`);
    ``params``: the parameters ``x`` is made of, marked for Adam's frozen-variance step when
    it goes through the momentum space.
    """
    comm = state.comm()
    world = comm.world_size
    if dense:  # Adam: a dense bucket sends the gradient (AdamW's own step)
        flag = local_flagged(state, index, x, world, _limit(state, world))
        return _plain_allreduce(state, comm, index, step, x, flag, scatter)
    name = state.algorithm_for(index, x.numel(), x.dtype)
    # the auto planner may move a bucket between algorithms (autotune trials): residuals of
    # the old one are added into the bucket once, so no gradient mass is lost
    prev = state.planner.note_used(index, name) if state.planner is not None else None
    switched = prev is not None and prev != name
    if name == DENSE:
        return _route_dense(state, comm, x, index, step, scatter, prev, switched)
    state.memory.draining.pop(index, None)  # back to compressing: what is left is a residual again
    # warm-up variant (DGC; in Adam's momentum space its ramp starts when the variance froze)
    compressor = state.compressor_at(step if mbar is None else step - state.adam.freeze_iter + state.start_iter)
    alg = get_algorithm(name)
    if mbar is not None and not switched and compressor is not state.compressor and \
            _warm_step_goes_dense(alg, compressor, x, world):
        # Adam's momentum space: a dense step of the ramp is AdamW's own step on the average
        _record(state, index, x, world, DENSE)
        return _averaged_allreduce(state, comm, index, step, x, scatter)
    if mbar is not None:
        state.adam.mark(params, step)
    amax = feed_(state, index, x, world, _limit(state, world), mbar)
    if switched:
        _flush_residual_(x, state.algo_store.get(index, {}), prev, comm)
        state.algo_store.pop(index, None)  # stores belong to one algorithm
        amax = None
    # it travels with the step's flag allreduce
    flag = nonfinite_flag(x, amax)
    if compressor is not state.compressor and _warm_step_goes_dense(alg, compressor, x, world):
        # the lossless end of the ramp: the residual (already in x) goes with it; the velocity
        # goes on; flagged like a compressed step (a NaN resets the bucket's memory)
        state.memory.residuals.pop(index, None)
        _record(state, index, x, world, DENSE)
        return _plain_allreduce(state, comm, index, step, x, flag, scatter, "dense allreduce (warm-up)")
    masking = deliver = None
    if mbar is not None:
        masking = state.adam.masking(step)
        deliver = mbar.deliver_
    return _run_algorithm(state, comm, alg, compressor, x, index, step, scatter, shapes, flag,
                          masking, deliver)


def _run_algorithm(state, comm, alg, compressor, x, index, step, scatter, shapes, flag, masking,
                   deliver=None):
    """The algorithm's rounds on the fed ``x``, then :func:`~comms.pipeline.settle_` once the
    result is in (and ``deliver(x)``: Adam's new momentum from the aggregate), through the
    step's flags."""
    ctx = Context(numel=x.numel(), dtype=x.dtype, device=x.device, step=step,
                  bucket=index, rank=comm.rank, seed=state.seed, shapes=shapes)
    _record(state, index, x, comm.world_size, alg.name,
            lambda: alg.bucket_wire_bytes(compressor, ctx, comm.world_size), compressor)
    what = where(comm, f"{alg.name} collective", index, x.numel(), x.dtype, step)
    delivery = Delivery(state, compressor, alg.holds_back, masking)
    try:
        fut = alg(comm, compressor, x, ctx, state.store(index),
                  **delivery.algorithm_kwargs(state, alg, index, x))
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
        out = settle_(state, index, x, total, own, delivery)
        return out if deliver is None else deliver(out)

    return state.flags.enqueue(index, step, flag, x, fut.then(finish), scatter, what=what)


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


def _begin_bucket(state: CompressionState, bucket: dist.GradBucket, buf: torch.Tensor, index: int,
                  step: int):
    """Per-step bookkeeping before a bucket moves: the planner's first-call setup (collective,
    once), its step and bucket observations, the replica guard; returns the communicator."""
    comm = state.comm()
    if state.planner is not None and comm.world_size > 1:
        if not state.planner.ready:
            # first call: every rank is here and nothing is in flight — discover the topology,
            # build its groups and probe the links (collective), once
            state.communicator = state.planner.setup(comm, state.process_group)
            comm = state.comm()
        if index == 0:  # DDP launches bucket 0 first, after the last step's futures were waited
            state.planner.begin_step(step, _start(state, step), buf.numel(), buf.dtype,
                                     state.warmup_steps)
        state.planner.observe(index, buf.numel(), buf.dtype, bucket)
    if index == 0 and state.replica_guard is not None and comm.world_size > 1:
        state.replica_guard.maybe_check(step, comm)  # raises on every rank at a mismatch
    return comm


def _shapes_at(bucket: dist.GradBucket, numel: int) -> dict:
    """Buffer offset -> ``(numel, shape)`` of each parameter; ``{}`` for a layout we do not
    understand (shapes unknown)."""
    shape_at, off = {}, 0
    for p in bucket.parameters():
        shape_at[off] = (p.numel(), tuple(p.shape))
        off += p.numel()
    return shape_at if off == numel else {}


def _split_bucket(state, buf, plan, shape_at, step, dense, mbar=None, params=()) -> torch.futures.Future:
    """A bucket whose parameters map onto several residual layouts (a resumed run's layouts,
    DDP's rebuilt buckets): each part goes through the pipeline under its own index."""
    subs = []
    offsets = list(shape_at) if len(shape_at) == len(params) else [None] * len(params)
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
        part = None if mbar is None else mbar.cut(segs)
        mine = [p for p, o in zip(params, offsets) if o is None or any(a <= o < a + n for a, n in segs)]
        subs.append(_compress_flat(state, x, j, step, scatter, shapes=shapes, dense=dense, mbar=part,
                                   params=mine))
    return when_all(subs, buf)


def _exchange(state, comm, bucket, buf, index: int, step: int) -> torch.futures.Future:
    """The bucket's configuration check (once per layout), then a plain averaged allreduce
    (before ``start_iter``, small buckets, no local steps) or the pipeline."""
    state.flags.drop_stale(step)
    state.config_check.check(comm, index, buf, step,
                             lambda: state.config_hash(index, buf.numel(), buf.dtype, step),
                             lambda: state.config_values(index, buf.numel(), buf.dtype, step))
    dense = step < _start(state, step) or buf.numel() < state.min_compress_numel
    mbar = None if dense else _shared_momentum(state, bucket, step)
    if dense and not state.local_transform:
        return _averaged_allreduce(state, comm, index, step, buf)
    plan = _layout_plan(state, bucket, buf, index)
    shape_at = _shapes_at(bucket, buf.numel())
    params = bucket.parameters()
    if plan == [(index, None)]:
        shapes = tuple(s for _, s in shape_at.values())
        return _compress_flat(state, buf, index, step, shapes=shapes, dense=dense, mbar=mbar,
                              params=params)
    return _split_bucket(state, buf, plan, shape_at, step, dense, mbar, params)


def _start(state: CompressionState, step: int) -> int:
    """The first compressed step: ``start_iter``, or later while Adam's variance settles."""
    return state.start_iter if state.adam is None else state.adam.start(step, state.start_iter)


def _shared_momentum(state: CompressionState, bucket, step: int):
    """Adam's share of the bucket once the variance froze (a :class:`comms.adam.Share`: the
    shared momentum and the preconditioner), else None. Only ``"shared"`` reads the momentum
    every step; a velocity per rank reads it to start."""
    if state.adam is None or not state.adam.active(step):
        return None
    needs = state.adam.mode == "shared" or (state.adam.mode == "local"
                                            and bucket.index() not in state.memory.velocities)
    return state.adam.share(bucket.parameters(), needs)


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
    comm = _begin_bucket(state, bucket, buf, index, step)
    if comm.world_size == 1 or buf.numel() == 0:
        mbar = _shared_momentum(state, bucket, step)
        if mbar is not None:
            state.adam.mark(bucket.parameters(), step)
        if (state.local_transform or mbar is not None) and buf.numel():
            local_(state, index, buf, 1, state.clip_norm, mbar)  # the momentum the optimizer no longer applies
            if mbar is not None:
                mbar.deliver_(buf)
        fut = completed(buf)  # nothing to exchange: the average of one is itself
    else:
        fut = _exchange(state, comm, bucket, buf, index, step)
    if state.adam is not None and index == 0:  # the factor the loop applies to .grad afterwards
        params = bucket.parameters()             # (comms.adam); one bucket: the same on every rank
        fut = fut.then(lambda f: state.adam.loop.probe(params, f.value(), step))
    if last:
        state.flags.flush(comm, step, _on_nonfinite(state))
        state.layout_tracker.end_step()
    return fut
