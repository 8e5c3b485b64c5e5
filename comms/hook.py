"""``compression_hook``: the DDP communication hook that compresses each gradient bucket.

Guarantees (see README "Troubleshooting and guarantees"):

* **Configuration check.** The first call for each bucket layout allgathers one int64 hash
  per field of :data:`comms.state.CONFIG_FIELDS` (compressor spec, algorithm, seed,
  start_iter, ..., step, bucket numel and dtype) and raises ``ValueError`` on every rank,
  naming the field and this rank's value, before the bucket's data moves.
* **Non-finite gradients.** Each compressed bucket computes a non-finite flag as a tensor
  (no host sync); the flags of all buckets of a step ride one tiny allreduce issued with the
  step's last bucket. A bucket flagged on any rank comes back all-NaN on every rank (so
  ``GradScaler`` skips the step, as with plain allreduce), and its residual and algorithm
  store are reset on every rank. The flag is read on the host once per step, in a future
  callback that runs after the flag allreduce has finished.
* **Failures.** A collective that fails (dead peer, process-group timeout) completes the
  bucket's future with a ``RuntimeError`` naming the algorithm or collective, the bucket,
  its size, the step and the rank.
* **Bucket layouts.** Residuals and stores belong to a bucket *layout* (its parameters in
  order). When DDP rebuilds its buckets each parameter's residual moves with it to its new
  position (the algorithm store starts afresh); when a freshly started process sees DDP's
  first-iteration buckets after ``load_state_dict``, each saved bucket is cut out of the
  current one and compressed exactly as before, so a resumed run is bitwise identical to an
  uninterrupted one.
"""


import logging

import torch
import torch.distributed as dist

from compressors import Context

from .algorithms import get_algorithm
from .autotune import flush_owner_residual_
from .futures import completed
from .state import CONFIG_FIELDS, BucketStats, CompressionState

__all__ = ["compression_hook", "dense_allreduce"]

logger = logging.getLogger(__name__)


def _where(state, what: str, bucket: int, numel: int, dtype, step: int) -> str:
    comm = state.comm()
    return (f"commpress: {what} of bucket {bucket} ({numel} x {str(dtype).replace('torch.', '')}) "
            f"at step {step} on rank {comm.rank} of {comm.world_size}")


def _guarded(fut: torch.futures.Future, where: str) -> torch.futures.Future:
    """Re-raise a failed collective as a RuntimeError that says which one failed."""

    def check(f):
        try:
            return f.value()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise RuntimeError(f"{where} failed: {exc}") from exc

    return fut.then(check)


def dense_allreduce(state: CompressionState, buf: torch.Tensor) -> torch.futures.Future:
    """Plain averaged allreduce of ``buf`` in place (DDP's default behaviour)."""
    comm = state.comm()
    buf.div_(comm.world_size)  # divide first, as torch's hooks do, to avoid fp16 overflow
    return comm.all_reduce(buf)


def _check_config(state: CompressionState, index: int, buf: torch.Tensor, step: int) -> None:
    """Once per (bucket, numel, dtype): every rank must run the same configuration."""
    key = (index, buf.numel(), buf.dtype)
    if key in state._checked:
        return
    comm = state.comm()
    mine = state.config_hash(index, buf.numel(), buf.dtype, step)
    t = torch.tensor(mine, dtype=torch.int64)
    if buf.device.type != "cpu" and comm.backend not in ("gloo", "mpi"):
        t = t.to(buf.device)
    where = _where(state, "configuration-check allgather", index, buf.numel(), buf.dtype, step)
    try:  # one host sync per bucket layout: what follows depends on the answer
        table = comm.all_gather(t).wait().view(comm.world_size, len(mine)).cpu().tolist()
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"{where} failed: {exc}") from exc
    values = state.config_values(index, buf.numel(), buf.dtype, step)
    for f, field in enumerate(CONFIG_FIELDS):
        differ = [r for r, row in enumerate(table) if row[f] != table[0][f]]
        if differ:
            odd = [r for r, row in enumerate(table) if row[f] != mine[f]]
            raise ValueError(
                f"commpress: compressor configuration differs between ranks at bucket {index}: "
                f"{field} is {values[f]!r} on rank {comm.rank}, different on rank(s) {odd}; every "
                "rank must use the same compressor spec, algorithm, seed, start_iter, options, "
                "step counter and bucket layout")
    state._checked.add(key)


class _Pending:
    """A compressed (sub-)bucket of this step waiting for the step's non-finite flags."""

    __slots__ = ("bucket", "step", "flag", "x", "fut", "result", "scatter")

    def __init__(self, bucket, step, flag, x, fut, scatter):
        self.bucket, self.step, self.flag, self.x, self.fut = bucket, step, flag, x, fut
        self.scatter = scatter
        self.result = torch.futures.Future()


def _record_dense(state: CompressionState, index: int, x: torch.Tensor, world: int) -> None:
    """Account a bucket the planner sent dense: wire bytes == dense bytes, algorithm "dense"."""
    st = state.stats.get(index)
    if st is None or st.numel != x.numel() or st.algorithm != "dense":
        dense = 2 * (world - 1) * x.numel() * x.element_size() // world
        st = state.stats[index] = BucketStats(index, x.numel(), x.dtype, "dense", dense, dense)
    st.calls += 1


def _compress_flat(state: CompressionState, x: torch.Tensor, index: int, step: int,
                   scatter=None, shapes: tuple = ()) -> torch.futures.Future:
    """EF + compress + aggregate one flat tensor in place; returns the (pending) future.

    ``shapes``: the shapes of the parameters ``x`` is made of, in order (``()``: unknown);
    they reach the compressor as ``Context.shapes`` (PowerSGD factorizes each matrix).
    """
    comm = state.comm()
    world = comm.world_size
    compressor = state.compressor
    name = state.algorithm_for(index, x.numel(), x.dtype)
    # the auto planner may move a bucket between algorithms (autotune trials): residuals of
    # the old one are added into the bucket once, so no gradient mass is lost
    prev = state.planner.note_used(index, name) if state.planner is not None else None
    switched = prev is not None and prev != name
    if name == "dense":  # the auto planner routes this bucket to the plain allreduce
        state.dense_calls += 1
        _record_dense(state, index, x, world)
        where = _where(state, "dense allreduce", index, x.numel(), x.dtype, step)
        if not switched:
            return _enqueue(state, index, step, None, x, _guarded(dense_allreduce(state, x), where), scatter)
        x.div_(world)
        if state.error_feedback:
            state.memory.add_residual_(index, x)
        flush_owner_residual_(x, state.algo_store.get(index, {}), prev, comm)
        state.reset_bucket(index)
        return _enqueue(state, index, step, None, x, _guarded(comm.all_reduce(x), where), scatter)
    alg = get_algorithm(name)
    x.div_(world)
    if state.error_feedback:
        state.memory.add_residual_(index, x)
    if switched:
        flush_owner_residual_(x, state.algo_store.get(index, {}), prev, comm)
        state.algo_store.pop(index, None)  # stores belong to one algorithm
    # a tensor, not a bool: no host sync here; it travels with the step's flag allreduce
    # a plain sum (no float64 copy of the bucket): NaN/Inf anywhere makes it non-finite; a
    # finite bucket whose sum overflows fp32 (|sum| > 3e38) is flagged too, which is right
    flag = ~torch.isfinite(x.sum(dtype=torch.float32))  # fp16 sums would overflow at 65504
    ctx = Context(numel=x.numel(), dtype=x.dtype, device=x.device, step=step,
                  bucket=index, rank=comm.rank, seed=state.seed, shapes=shapes)
    st = state.stats.get(index)
    if st is None or st.numel != x.numel() or st.algorithm != alg.name:
        dense = 2 * (world - 1) * x.numel() * x.element_size() // world
        wire = alg.wire_bytes(compressor, x.numel(), x.dtype, world)
        shaped = getattr(compressor, "shaped_wire_bytes", None)
        if shaped is not None and alg.name == "allreduce" and ctx.known_shapes():
            # per-tensor payloads (PowerSGD per layer): the ring allreduce of their bytes
            wire = 2 * (world - 1) * shaped(ctx.known_shapes(), x.dtype) // world
        st = state.stats[index] = BucketStats(index, x.numel(), x.dtype, alg.name, dense, wire)
    st.calls += 1
    where = _where(state, f"{alg.name} collective", index, x.numel(), x.dtype, step)
    fut = alg(comm, compressor, x, ctx, state.store(index))

    def finish(f):
        try:
            total, own = f.value()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise RuntimeError(f"{where} failed: {exc}") from exc
        if state.error_feedback:
            state.memory.update_(index, x, own)
        x.copy_(total)
        return x

    return _enqueue(state, index, step, flag, x, fut.then(finish), scatter)


def _enqueue(state, index, step, flag, x, fut, scatter=None) -> torch.futures.Future:
    """Hold a bucket's future until the step's flag allreduce (``flag`` None: a dense bucket)."""
    p = _Pending(index, step, flag, x, fut, scatter)
    state._pending.append(p)
    return p.result


def _settle(state: CompressionState, p: _Pending, i: int, flags_fut) -> None:
    try:
        x = p.fut.value()
        flags = flags_fut.value()
        bad = p.flag is not None and flags[i] > 0
        if bad:
            # as with plain allreduce, the non-finite value reaches every rank; the
            # residual and store must not keep it
            x.fill_(float("nan"))
            state.reset_bucket(p.bucket)
            state.nonfinite_buckets += 1
            msg = ("commpress: non-finite gradient in bucket %d at step %d: the bucket is NaN on "
                   "every rank (GradScaler skips the step) and its error-feedback residual and "
                   "algorithm store were reset (state.nonfinite_buckets counts these)")
            if not state._warned_nonfinite:
                state._warned_nonfinite = True
                logger.warning(msg + "; logged once", p.bucket, p.step)
            else:
                logger.debug(msg, p.bucket, p.step)
        if p.scatter is not None:
            p.scatter(x)
        p.result.set_result(x)
    except BaseException as exc:  # noqa: BLE001 - forwarded to DDP
        p.result.set_exception(exc)


def _flush_pending(state: CompressionState, step: int) -> None:
    """At the step's last bucket: one allreduce of every compressed bucket's non-finite flag."""
    pending, state._pending = state._pending, []
    if not pending:
        return
    comm = state.comm()
    device = pending[-1].x.device
    no = torch.zeros((), dtype=torch.bool, device=device)
    # the last element counts the ranks: gloo can hand back garbage instead of an error once a
    # peer has died, so a count != world means this step's results cannot be trusted
    flags = torch.cat([torch.stack([no if p.flag is None else p.flag for p in pending]).to(torch.float32),
                       torch.ones(1, device=device)])
    if device.type != "cpu" and comm.backend in ("gloo", "mpi"):
        flags = flags.cpu()
    where = _where(state, "non-finite-flag allreduce", pending[-1].bucket, flags.numel(),
                   flags.dtype, step)
    world = comm.world_size

    def host(f):
        vals = f.value().tolist()  # one host read per step, after the collective finished
        if vals[-1] != world:
            raise RuntimeError(f"{where} returned a rank count of {vals[-1]:g} instead of {world}: "
                               "a peer died or disconnected; this step's results are discarded")
        return vals

    try:
        ffut = _guarded(comm.all_reduce(flags), where).then(host)
    except Exception as exc:  # noqa: BLE001
        ffut = torch.futures.Future()
        ffut.set_exception(RuntimeError(f"{where} failed: {exc}"))
    for i, p in enumerate(pending):
        # not collect_all: it completes at the first error, before the other future is done
        p.fut.add_done_callback(
            lambda _f, p=p, i=i: ffut.add_done_callback(lambda _g: _settle(state, p, i, ffut)))


def _when_all(futs, value) -> torch.futures.Future:
    """A future of ``value`` once every one of ``futs`` is done (the first error wins)."""
    out = torch.futures.Future()
    left = [len(futs)]

    def one(_f):
        left[0] -= 1
        if left[0] == 0:
            try:
                for f in futs:
                    f.value()
                out.set_result(value)
            except BaseException as exc:  # noqa: BLE001 - forwarded to DDP
                out.set_exception(exc)

    for f in futs:
        f.add_done_callback(one)
    return out


def _drop_stale(state: CompressionState, step: int) -> None:
    # a step that raised half-way never flushed; do not let its buckets wait forever
    stale = [p for p in state._pending if p.step != step]
    if stale:
        state._pending = [p for p in state._pending if p.step == step]
        for p in stale:
            p.result.set_exception(RuntimeError(f"commpress: step {p.step} was abandoned"))


def _layout_plan(state: CompressionState, bucket: dist.GradBucket, buf: torch.Tensor, index: int):
    """``[(sub_index, segments)]``: how to compress this bucket given the known layouts.

    ``segments`` is ``None`` for the whole bucket, else the ``(offset, numel)`` slices of
    ``buf`` that form saved bucket ``sub_index``: in the first step after
    ``load_state_dict`` DDP has not rebuilt its buckets yet, and compressing the saved
    buckets exactly as they were keeps a resumed run bitwise equal to an uninterrupted one.
    Otherwise a changed layout (DDP rebuilt its buckets) takes over its parameters'
    residuals, moved to their new positions; the algorithm store starts afresh.
    """
    params = bucket.parameters()
    keys = tuple(state.param_key(p) for p in params)
    if state.layouts.get(index) == keys:
        return [(index, None)]
    numels = [p.numel() for p in params]
    kset = set(keys)
    if state._restored:
        covered = sorted(j for j, lay in state.layouts.items() if lay and set(lay) <= kset)
        if covered and set().union(*(state.layouts[j] for j in covered)) == kset \
                and sum(numels) == buf.numel():
            offsets, off = {}, 0
            for k, n in zip(keys, numels):
                offsets[k] = (off, n)
                off += n
            logger.info("bucket %d holds saved buckets %s: compressing them as saved", index, covered)
            return [(j, [offsets[k] for k in state.layouts[j]]) for j in covered]
    # a new layout: cut the residuals of the layouts it overlaps into per-parameter pieces
    # (later buckets of this step may claim the rest), then assemble this bucket's residual
    sizes = state._param_numels
    sizes.update(zip(keys, numels))
    for j, lay in list(state.layouts.items()):
        if j == index or kset & set(lay):
            r = state.memory.residuals.get(j)
            if r is not None and all(k in sizes for k in lay) and sum(sizes[k] for k in lay) == r.numel():
                off = 0
                for k in lay:
                    state._loose[k] = r[off: off + sizes[k]]
                    off += sizes[k]
            del state.layouts[j]
            state.reset_bucket(j)
    state.reset_bucket(index)
    state.layouts[index] = keys
    if state.error_feedback and any(k in state._loose for k in keys) and sum(numels) == buf.numel():
        r = torch.zeros_like(buf)
        off = 0
        for k, n in zip(keys, numels):
            piece = state._loose.pop(k, None)
            if piece is not None and piece.numel() == n and piece.dtype == buf.dtype:
                r[off: off + n].copy_(piece)
            off += n
        state.memory.residuals[index] = r
    return [(index, None)]


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
            comm = state.communicator = state.planner.setup(comm, state.process_group)
        if index == 0:  # DDP launches bucket 0 first, after the last step's futures were waited
            state.planner.begin_step(step, state.start_iter, buf.numel(), buf.dtype)
        state.planner.observe(index, buf.numel(), buf.dtype, bucket)
    if index == 0 and state.replica_guard is not None and comm.world_size > 1:
        state.replica_guard.maybe_check(step, comm)  # raises on every rank at a mismatch
    if comm.world_size == 1 or buf.numel() == 0:
        fut = completed(buf)  # nothing to exchange: the average of one is itself
    else:
        _drop_stale(state, step)
        _check_config(state, index, buf, step)
        if step < state.start_iter or buf.numel() < state.min_compress_numel:
            state.dense_calls += 1
            where = _where(state, "dense allreduce", index, buf.numel(), buf.dtype, step)
            fut = _enqueue(state, index, step, None, buf, _guarded(dense_allreduce(state, buf), where))
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
                fut = _compress_flat(state, buf, index, step, shapes=shapes)
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
                    subs.append(_compress_flat(state, x, j, step, scatter, shapes=shapes))
                fut = _when_all(subs, buf)
    if last:
        _flush_pending(state, step)
        state._restored = False
        state._loose.clear()
    return fut
