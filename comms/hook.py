"""``compression_hook``: the DDP communication hook that compresses each gradient bucket."""


import logging

import torch
import torch.distributed as dist

from compressors import Context

from .algorithms import get_algorithm
from .futures import completed
from .state import BucketStats, CompressionState

__all__ = ["compression_hook", "dense_allreduce"]

logger = logging.getLogger(__name__)


def dense_allreduce(state: CompressionState, buf: torch.Tensor) -> torch.futures.Future:
    """Plain averaged allreduce of ``buf`` in place (DDP's default behaviour)."""
    comm = state.comm()
    buf.div_(comm.world_size)  # divide first, as torch's hooks do, to avoid fp16 overflow
    return comm.all_reduce(buf)


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a gradient bucket over the group with compression and error feedback.

    The first ``state.start_iter`` iterations use plain allreduce (DDP rebuilds its buckets
    after iteration 0). Afterwards the bucket is divided by the world size, its residual
    added, compressed, moved with ``state.algorithm``, decoded identically on every rank and
    written back into ``bucket.buffer()``.

    Args:
        state: a :class:`~comms.state.CompressionState`.
        bucket: DDP's gradient bucket.

    Returns:
        A future whose value is ``bucket.buffer()`` holding the averaged gradient.

    Example::

        >>> state = comms.CompressionState("topk:density=0.01")
        >>> ddp_model.register_comm_hook(state, comms.compression_hook)

    .. warning::
        Residuals are per rank and per bucket layout: save ``state.state_dict()`` on every
        rank to resume bit-exactly.
    """
    buf = bucket.buffer()
    index = bucket.index()
    step = state.iter
    if bucket.is_last():
        state.iter += 1
    comm = state.comm()
    world = comm.world_size
    if world == 1:
        return completed(buf)
    if step < state.start_iter or buf.numel() < max(1, state.min_compress_numel):
        state.dense_calls += 1
        return dense_allreduce(state, buf)

    compressor = state.compressor
    alg = get_algorithm(state.algorithm)
    buf.div_(world)
    if state.error_feedback:
        state.memory.add_residual_(index, buf)
    ctx = Context(numel=buf.numel(), dtype=buf.dtype, device=buf.device, step=step,
                  bucket=index, rank=comm.rank, seed=state.seed)
    st = state.stats.get(index)
    if st is None or st.numel != buf.numel():
        dense = 2 * (world - 1) * buf.numel() * buf.element_size() // world
        st = state.stats[index] = BucketStats(index, buf.numel(), buf.dtype, alg.name, dense,
                                              alg.wire_bytes(compressor, buf.numel(), buf.dtype, world))
    st.calls += 1
    fut = alg(comm, compressor, buf, ctx, state.store(index))

    def finish(f):
        total, own = f.value()
        if state.error_feedback:
            state.memory.update_(index, buf, own)
        buf.copy_(total)
        return buf

    return fut.then(finish)
