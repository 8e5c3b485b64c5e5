"""CUDA dispatch of the aggregation algorithms' own kernels (csrc/shared_scale.cu,
csrc/two_phase.cu); every function returns ``None`` to mean "use the torch path".

Results are bit-identical to the torch references in ``shared_scale.py``
(``quantize_reference``, ``decode_reference``) and ``two_phase.py`` (the owner's decode-sum-
requantize). The shared-scale kernels take ``L / s`` and ``s / L`` computed by the caller with
the reference's torch ops, so they match torch on the same device. Compressor kernels are
routed by :mod:`compressors.cuda.dispatch`; both launch through :mod:`compressors.cuda.kernels`.
"""

from __future__ import annotations

import logging

import torch

from compressors.cuda import dispatch, kernels
from compressors.hashrng import stream_key

__all__ = ["shared_scale_quantize", "shared_scale_decode", "two_phase_qsgd_owner"]

logger = logging.getLogger(__name__)


# -- shared-scale integer quantization (comms/algorithms/shared_scale.py) ----------------------
def shared_scale_quantize(x, chunk, scales, levels, wire_dtype, key, own_dtype):
    """Steps 2 of ``shared_scale``: ``(q, own, step)`` with ``inv = L / s`` and ``step = s / L``
    computed by the reference's torch ops on this device; or None.

    ``key`` is the reference's stream key (``stream_key(seed, step, bucket ^ salt, rank)``).
    """
    if wire_dtype not in (torch.int8, torch.int32) or not (dispatch.enabled_for(x, scales) and dispatch._float_ok(x)):
        return None
    if own_dtype is not None and own_dtype not in kernels.DTYPE_CODE:
        return None
    inv = torch.where(scales > 0, levels / scales, torch.zeros_like(scales))
    step = scales / levels
    q, own = kernels.shared_scale_encode(x.reshape(-1), chunk, inv, step, levels, key, wire_dtype, own_dtype)
    return q, own, step


def shared_scale_decode(summed, chunk, step, dtype):
    """Step 3 of ``shared_scale``: ``(float(sum) * step).to(dtype)``; or None."""
    if summed.dtype not in (torch.int8, torch.int32) or dtype not in kernels.DTYPE_CODE:
        return None
    if not dispatch.enabled_for(summed, step):
        return None
    return kernels.shared_scale_decode(summed.reshape(-1), chunk, step, dtype)


# -- two-phase owner step ---------------------------------------------------------------------
def two_phase_qsgd_owner(compressor, recv, world, m, ctx2, residual_in=None, residual_out=None):
    """Fused owner step of ``two_phase`` for QSGD payloads in fp32: decode the ``world`` wire
    payloads of ``recv`` in rank order, sum (+ ``residual_in``), re-quantize with ``ctx2``'s
    stream; writes ``residual_out`` when given. Returns the owner payload or None."""
    if getattr(compressor, "name", None) != "qsgd" or ctx2.dtype != torch.float32:
        return None
    if compressor._segments(ctx2) is not None:
        return None  # tensor-aligned pieces: per-piece scales and streams, not one flat payload
    bits, chunk = compressor.bits, compressor.chunk
    nch = -(-m // chunk)
    seg = 4 * nch + (m * bits + 7) // 8
    if recv.dtype != torch.uint8 or recv.numel() != world * seg or chunk % 8:
        return None  # the kernel encodes whole groups of 8 per chunk (torch path otherwise)
    extra = [t for t in (residual_in, residual_out) if t is not None]
    if any(t.dtype != torch.float32 or t.numel() != m for t in extra) or not dispatch.enabled_for(recv, *extra):
        return None
    # static + dynamic shared memory (the static part is known once the kernel is compiled)
    if not kernels.two_phase_fits(chunk, world, kernels._dev(recv)):
        return None
    return kernels.two_phase_qsgd_owner(recv, world, m, bits, chunk, stream_key(
        ctx2.seed, ctx2.step, ctx2.bucket, ctx2.rank), residual_in, residual_out)
