"""Route CUDA tensors to the ``csrc/`` kernels; every function returns ``None`` to mean
"use the torch path" (no CuPy, no CUDA, a CPU tensor, an unsupported dtype or layout).

The compressors call these at the top of their methods::

    if x.is_cuda:
        out = dispatch.qsgd_compress(self, x, ctx)
        if out is not None:
            return out

Results are bit-identical to the torch reference of the same compressor (see each function).

.. warning::
    Division semantics. The documented formats use true fp32 division (``w = fl(fl(2 s) / M)``)
    and the kernels do exactly that, as torch does on CPU. torch on CUDA computes
    ``tensor / python_float`` as a multiplication by the reciprocal (up to 1 ulp apart), so
    ``QSGD.decompress`` run through torch ops on a CUDA tensor can differ from both. Payloads
    (what goes on the wire) are unaffected; decoded values are. A job must therefore not mix
    ranks that have the kernels with ranks that do not (same CuPy availability everywhere),
    or the reference should divide by a tensor (``torch.full_like(s, M)``) so both agree.

The algorithms' own kernels (shared-scale encode/decode, the fused two-phase owner step) are
dispatched from ``comms/algorithms/cuda_kernels.py``; this module routes compressor kernels.
"""

from __future__ import annotations

import logging
import math

import torch

from ..hashrng import lowbias32_int, stream_key
from . import kernels, loader

__all__ = [
    "enabled_for", "qsgd_compress", "qsgd_decompress", "qsgd_decompress_add_", "sign_compress",
    "sign_decompress", "sign_decompress_add_", "topk_compress", "topk_decompress_add_",
]

logger = logging.getLogger(__name__)


def enabled_for(*tensors: torch.Tensor) -> bool:
    """All tensors on one CUDA device where the kernels are available, and contiguous."""
    if not tensors or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return False
    dev = tensors[0].device
    if any(t.device != dev or not t.is_contiguous() for t in tensors):
        return False
    return loader.available(dev)


def _float_ok(*tensors) -> bool:
    return all(t.dtype in kernels.DTYPE_CODE for t in tensors)


def _key(ctx) -> int:
    return stream_key(ctx.seed, ctx.step, ctx.bucket, ctx.rank)


# -- QSGD ------------------------------------------------------------------------------------
def qsgd_compress(compressor, x, ctx):
    """``QSGD.compress``: ``[scales, packed]`` with the same bits, or None."""
    if not (enabled_for(x) and _float_ok(x)) or x.numel() == 0:
        return None
    return kernels.qsgd_compress(x.reshape(-1), compressor.bits, compressor.chunk, _key(ctx))


def _qsgd_payload_ok(payload, ctx, compressor) -> bool:
    if len(payload) != 2 or not enabled_for(*payload):
        return False
    s, packed = payload
    n = ctx.numel
    return (s.dtype == torch.float32 and packed.dtype == torch.uint8
            and s.numel() == -(-n // compressor.chunk)
            and packed.numel() >= (n * compressor.bits + 7) // 8)


def _out_ok(out, payload, ctx) -> bool:
    return out is None or (out.dtype == ctx.dtype and out.numel() == ctx.numel
                           and enabled_for(out, payload[0]))


def qsgd_decompress(compressor, payload, ctx, out=None):
    """``QSGD.decompress`` (true-division decode step, see the module warning), or None; with
    ``out`` (flat, ``ctx.dtype``), written into it."""
    if (ctx.dtype not in kernels.DTYPE_CODE or not _qsgd_payload_ok(payload, ctx, compressor)
            or not _out_ok(out, payload, ctx)):
        return None
    s, packed = payload
    return kernels.qsgd_decompress(s, packed, compressor.bits, compressor.chunk, ctx.numel, ctx.dtype,
                                   out=out)


def qsgd_decompress_add_(compressor, payload, ctx, acc):
    """``acc.add_(QSGD.decompress(payload, ctx))`` fused, for fp32 ``ctx.dtype`` and ``acc``."""
    if (ctx.dtype != torch.float32 or acc.dtype != torch.float32 or acc.numel() != ctx.numel
            or not _qsgd_payload_ok(payload, ctx, compressor) or not enabled_for(acc, payload[0])):
        return None
    s, packed = payload
    return kernels.qsgd_decompress(s, packed, compressor.bits, compressor.chunk, ctx.numel,
                                   torch.float32, acc=acc)


# -- ScaledSign --------------------------------------------------------------------------------
def sign_compress(compressor, x, ctx):
    """``ScaledSign.compress``: scales by the compressor's own torch reduction (torch fixes no
    summation order, so only the same op on the same device gives the same bits), sign bits
    packed by one kernel pass. None when unavailable."""
    scales_of = getattr(compressor, "_scales", None)
    if scales_of is None or not (enabled_for(x) and _float_ok(x)) or x.numel() == 0:
        return None
    xf = x.reshape(-1)
    return [scales_of(xf.float()), kernels.sign_pack(xf)]


def _sign_payload_ok(payload, ctx, compressor) -> bool:
    if len(payload) != 2 or not enabled_for(*payload):
        return False
    s, packed = payload
    return (s.dtype == torch.float32 and packed.dtype == torch.uint8
            and s.numel() == -(-ctx.numel // compressor.chunk) and packed.numel() >= (ctx.numel + 7) // 8)


def sign_decompress(compressor, payload, ctx, out=None):
    """``ScaledSign.decompress`` (exactly ``+s``/``-s``), or None; with ``out`` (flat,
    ``ctx.dtype``), written into it."""
    if (ctx.dtype not in kernels.DTYPE_CODE or not _sign_payload_ok(payload, ctx, compressor)
            or not _out_ok(out, payload, ctx)):
        return None
    s, packed = payload
    return kernels.sign_decompress(s, packed, compressor.chunk, ctx.numel, ctx.dtype, out=out)


def sign_decompress_add_(compressor, payload, ctx, acc):
    """``acc.add_(ScaledSign.decompress(payload, ctx))`` fused, fp32 only; or None."""
    if (ctx.dtype != torch.float32 or acc.dtype != torch.float32 or acc.numel() != ctx.numel
            or not _sign_payload_ok(payload, ctx, compressor) or not enabled_for(acc, payload[0])):
        return None
    s, packed = payload
    return kernels.sign_decompress(s, packed, compressor.chunk, ctx.numel, torch.float32, acc=acc)


# -- TopK --------------------------------------------------------------------------------------
def topk_compress(compressor, x, ctx):
    """``TopK.compress`` with ``exact=False``: the sampled threshold as in the reference, the
    candidate compaction in one kernel pass, then the reference's own small torch ops on the
    candidates (sorted into ``torch.nonzero`` order first), so the payload has the same bits
    as the reference on the same device. ``exact=True`` (and ``k*8 >= n``) return None.

    .. warning::
        One host synchronisation (reading the candidate count), as in the reference, whose
        ``torch.nonzero`` synchronises too.
    """
    n = x.numel()
    k = compressor.k_for(n)
    if compressor.exact or k == 0 or k * 8 >= n or not (enabled_for(x) and _float_ok(x)):
        return None
    xf = x.reshape(-1)
    s = max(min(n, 2048), math.ceil(compressor.sample * n))
    stride = max(1, n // s)
    offset = lowbias32_int(_key(ctx)) % stride
    sample = xf[offset::stride].abs()  # == x.abs()[offset::stride] without the full |x| pass
    ks = min(sample.numel(), max(1, math.ceil(1.1 * k * sample.numel() / n)))
    thr = torch.topk(sample, ks, sorted=False).values.min()
    cap = min(n, max(2 * k, 4096))
    slots, count = kernels.topk_compact(xf, thr, cap)
    c = int(count.item())  # the one host sync (the reference's torch.nonzero has it too)
    if c > cap:  # the sample badly underestimated the threshold: rerun with room for all
        slots, count = kernels.topk_compact(xf, thr, c)
    cand = torch.sort(slots[:c]).values.long()  # ascending, as torch.nonzero returns them
    if c > k:
        cand = cand[torch.topk(xf[cand].abs(), k, sorted=False).indices]
    idx = cand
    vals = xf[idx]
    if idx.numel() < k:  # same padding as the reference: index 0, value 0
        pad = k - idx.numel()
        idx = torch.cat([idx, idx.new_zeros(pad)])
        vals = torch.cat([vals, vals.new_zeros(pad)])
    return [vals, idx.to(torch.int32)]


def topk_decompress_add_(compressor, payload, ctx, acc):
    """``acc.index_add_(0, idx, vals)`` by atomics for fp32 ``acc`` (a payload's indices are
    distinct except the zero-valued pads, so the order of the adds does not change bits)."""
    if len(payload) != 2 or acc.dtype != torch.float32 or not enabled_for(acc, *payload):
        return None
    vals, idx = payload
    if idx.dtype != torch.int32 or not _float_ok(vals) or vals.numel() != idx.numel():
        return None
    return kernels.scatter_add_(acc, idx, vals)
