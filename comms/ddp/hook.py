"""``compression_hook``: the DDP communication hook — a gradient bucket through the engine.

Per bucket: the configuration check (once per layout, :mod:`comms.core.config_check`), the
route (``state.router``: dense before ``start_iter`` and for small buckets; then the pinned
algorithm or the ``auto`` planner's), then :func:`comms.core.engine.run` on the flat bucket with this rank's
share of the average (``div`` = the world size). This adapter only translates: a bucket whose
parameters map onto several residual layouts (a resumed run's, DDP's rebuilt buckets) is split
into parts (:mod:`comms.ddp.layouts`), each part's result is scattered back, and every
result reaches DDP through the step's non-finite flags (:mod:`comms.ddp.step_flags`).
Guarantees are listed in README "Guarantees"; the invariants in ``comms/ARCHITECTURE.md``.
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects
import logging

import torch
import torch.distributed as dist

from ..algorithms import DENSE
from ..algorithms.dense import dense_allreduce as _dense_allreduce
from ..core.checkpoint import hash64
from ..core.engine import BEFORE_START, Call, Sink, run
from ..core.stages import local_
from ..transport.errors import clean_message, where
from ..transport.futures import completed, stream_mark, wait_mark, when_all
from .outer_switch import maybe_switch_to_outer
from .state import CompressionState

__all__ = ["compression_hook", "dense_allreduce", "DDPSink"]

logger = logging.getLogger(__name__)

_LABELS = {DENSE: "dense allreduce", "dense (warm-up)": "dense allreduce (warm-up)"}


class DDPSink(Sink):
    """DDP's side of the engine: the plain allreduce as the dense route; every result through
    the step's flags (one allreduce at the last bucket), a split bucket's part scattered back."""

    dense = _dense_allreduce

    def __init__(self, state: CompressionState):
        self.state = state

    def what(self, comm, call, label):
        x = call.x
        return where(comm, _LABELS.get(label, f"{label} collective"), call.index, x.numel(), x.dtype, call.step)

    def land(self, comm, call, alg, fut, flag, settle, what):
        st, x = self.state, call.x
        if alg is self.dense:
            st.dense_calls += 1
        # CUDA: what this thread enqueued while the payload is on the wire (the residual, the
        # own decode) must finish before the callback, on another stream, writes into x
        in_flight = stream_mark(x)

        def finish(f):
            try:
                result = f.value()
            except Exception as exc:  # noqa: BLE001 - re-raised with context (cleaned at the last hop)
                msg = clean_message(exc)
                raise RuntimeError(msg if msg.startswith("commpress:") else f"{what} failed: {msg}") from exc
            wait_mark(in_flight, x)
            return settle(result)

        return st.flags.enqueue(call.index, call.step, flag, x, fut.then(finish), call.dest, what=what)


def dense_allreduce(state: CompressionState, buf: torch.Tensor) -> torch.futures.Future:
    """Plain averaged allreduce of ``buf`` in place (DDP's default behaviour)."""
    comm = state.comm()
    buf.div_(comm.world_size)  # divide first, as torch's hooks do, to avoid fp16 overflow
    return comm.all_reduce(buf)


def _on_nonfinite(state: CompressionState):
    def reset(bucket: int, step: int) -> None:
        state.reset_flagged_(bucket, True)
        msg = ("commpress: non-finite gradient in bucket %d at step %d: the bucket is NaN on "
               "every rank (GradScaler skips the step) and its error-feedback residual and "
               "algorithm store were reset (state.nonfinite_buckets counts these)")
        if not state._warned_nonfinite:
            state._warned_nonfinite = True
            logger.warning(msg + "; logged once", bucket, step)
        else:
            logger.debug(msg, bucket, step)
    return reset


def _layout_plan(state: CompressionState, bucket: dist.GradBucket, buf: torch.Tensor, index: int):
    params = bucket.parameters()
    return state.layout_tracker.plan(index, [state.param_key(p) for p in params],
                                     [p.numel() for p in params], buf,
                                     [state.memory.residuals, state.memory.velocities],
                                     state.forget, state.error_feedback or state.local_transform)


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
            state.planner.begin_step(step, state.first_step(step), buf.numel(), buf.dtype,
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


def _part(state, comm, sink, x, index, step, mbar, shapes=(), scatter=None, route=None, params=()):
    """One flat part of a bucket through the engine, on its route (``state.router``);
    ``params``: the parameters it is made of (Adam's momentum space marks them)."""
    world = comm.world_size
    if route is None:
        route = state.router.route(state, comm, index, step, x.numel(), x.dtype)
    limit = None if state.clip_norm is None else state.clip_norm / world  # this rank's share
    call = Call(index, step, x, route, div=world, limit=limit, mbar=mbar, shapes=shapes, dest=scatter,
                params=params)
    return run(state, comm, call, sink)


def _split_bucket(state, comm, sink, buf, plan, shape_at, step, before_start, mbar=None,
                  params=()) -> torch.futures.Future:
    """A bucket whose parameters map onto several residual layouts (a resumed run's layouts,
    DDP's rebuilt buckets): each part goes through the engine under its own index."""
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
        subs.append(_part(state, comm, sink, x, j, step, part, shapes, scatter,
                          BEFORE_START if before_start else None, mine))
    return when_all(subs, buf)


def _exchange(state, comm, bucket, buf, index: int, step: int) -> torch.futures.Future:
    """The bucket's configuration check (once per layout), then the engine on the bucket (or
    on each part of a split one)."""
    state.flags.drop_stale(step)
    state.config_check.check(comm, index, buf, step,
                             lambda: [hash64(v) for v in state.config_values(index, buf.numel(), buf.dtype, step)],
                             lambda: state.config_values(index, buf.numel(), buf.dtype, step))
    sink = DDPSink(state)
    route = state.router.route(state, comm, index, step, buf.numel(), buf.dtype)
    mbar = None if route is BEFORE_START else _shared_momentum(state, bucket, step)
    if route is BEFORE_START and not state.local_transform:
        return _part(state, comm, sink, buf, index, step, None, route=route)  # no memory: no layout to follow
    plan = _layout_plan(state, bucket, buf, index)
    shape_at = _shapes_at(bucket, buf.numel())
    params = bucket.parameters()
    if plan == [(index, None)]:
        shapes = tuple(s for _, s in shape_at.values())
        return _part(state, comm, sink, buf, index, step, mbar, shapes, route=route, params=params)
    return _split_bucket(state, comm, sink, buf, plan, shape_at, step, route is BEFORE_START, mbar, params)


def _shared_momentum(state: CompressionState, bucket, step: int):
    """Adam's share of the bucket once the variance froze (a :class:`comms.core.adam_share.Share`:
    the shared momentum and the preconditioner), else None. Only ``"shared"`` reads the
    momentum every step; a velocity per rank reads it to start."""
    if state.adam is None or not state.adam.active(step):
        return None
    needs = state.adam.mode == "shared" or (state.adam.mode == "local"
                                            and bucket.index() not in state.memory.velocities)
    return state.adam.share(bucket.parameters(), needs)


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket over the group with compression and error feedback.

    The first ``state.start_iter`` iterations use plain allreduce. Afterwards the bucket is
    divided by the world size, its residual added, compressed, moved with the algorithm
    :meth:`~comms.ddp.state.CompressionState.algorithm_for` picks, decoded identically on every
    rank and written back into ``bucket.buffer()`` (:func:`comms.core.engine.run`).

    Args:
        state: a :class:`~comms.ddp.state.CompressionState`.
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
    step, last = state.iter, bucket.is_last()
    if last:
        state.iter += 1
    if state.outer is not None:  # communicate every H steps: this rank's own gradient, unaveraged
        return completed(buf)
    comm = _begin_bucket(state, bucket, buf, index, step)
    if index == 0 and state.auto_outer is not None and maybe_switch_to_outer(state, state.numel, buf.dtype):
        return completed(buf)  # the outer sync from this step on: this rank's own gradient
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
        params = bucket.parameters()             # (comms.core.adam); one bucket: the same on every rank
        fut = fut.then(lambda f: state.adam.loop.probe(params, f.value(), step))
    if last:
        state.flags.flush(comm, step, _on_nonfinite(state))
        state.layout_tracker.end_step()
    return fut
