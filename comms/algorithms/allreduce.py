"""``allreduce``: the linear family — payloads are summed elementwise by one allreduce.

Cost does not grow with world size. Used by FP16/BF16 casts, RandomK (shared indices),
Identity, and PowerSGD-style compressors whose factors are summed.
"""

from __future__ import annotations

import logging

import torch

from .wire import layout_of

__all__ = ["allreduce"]

logger = logging.getLogger(__name__)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def allreduce(comm, compressor, x, ctx, store):
    """Compress, sum the payload with one allreduce, decode the sum once.

    Every rank decodes the same summed bits, so results are replica-identical.
    """
    if hasattr(compressor, "linear_aggregate"):  # multi-round linear compressors (PowerSGD)
        return compressor.linear_aggregate(comm, x, ctx, store)
    payload = compressor.compress(x, ctx)
    own = compressor.decompress(payload, ctx)
    dtypes = {t.dtype for t in payload}
    if len(dtypes) != 1:
        raise TypeError(f"{compressor.name} payload mixes dtypes {sorted(map(str, dtypes))}; "
                        "the allreduce family needs one summable dtype")
    layout = layout_of(payload)
    if len(payload) == 1 and not _shares_memory(payload[0], x) and not _shares_memory(payload[0], own):
        wire = payload[0].reshape(-1)
    else:  # the allreduce works in place: never sum into x or own's memory
        wire = torch.cat([t.reshape(-1) for t in payload])

    def done(fut):
        summed, off = [], 0
        for n, _ in layout:
            summed.append(wire[off: off + n])
            off += n
        return compressor.decompress(summed, ctx), own

    return comm.all_reduce(wire).then(done)


allreduce.name = "allreduce"
allreduce.family = "allreduce"
allreduce.wire_bytes = lambda compressor, numel, dtype, world: (
    2 * (world - 1) * compressor.wire_bytes(numel, dtype) // world)
