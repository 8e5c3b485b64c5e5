"""``QSGD``: b-bit stochastic quantization with per-chunk max-abs scales, bit-packed.

Format (shared with csrc/quantize.cu; change both or neither). For chunk ``c`` of ``chunk``
elements (the last one may be short) with ``s = max|x|`` over the chunk, ``M = 2**bits - 1``
levels span ``[-s, s]`` uniformly (``bits=1`` is stochastic sign times s):

* encode: ``r = fp32(M/2) / s`` (0 when s == 0), ``t = fl(fl(x*r) + fp32(M/2))``,
  ``q = clamp(floor(fl(t + u)), 0, M)`` with ``u`` from the hash RNG stream
  ``stream_key(seed, step, bucket, rank)`` at the element's index;
* decode: ``w = fl(fl(2*s) / M)``, ``x' = fl(fl(q*w) - s)``.

Unbiased: ``E[q] = t`` because u is uniform, hence ``E[x'] = x``. Error per element <= ``w``
plus fp32 rounding (see :meth:`QSGD.error_bound`).
Payload: ``[scales (nchunks, fp32), codes (ceil(n*bits/8), uint8)]``.

Non-finite corner cases follow from the ops above (and the fast path reproduces them): a NaN
in a chunk makes ``s`` NaN and ``r = 0``; ``s == inf`` gives ``r = 0``; a tiny ``s`` (below
~``M/2 / FLT_MAX``) gives ``r = inf``; NaN ``t`` encode as code 0.

Implementation: the compiled kernels where they apply, else the torch path of
:mod:`compressors.qsgd_blocks` — the input processed in cache-sized blocks (:func:`block_elems`)
with scratch buffers reused across calls; each block's ops are the reference ops above, one
rounded fp32 op at a time, so the codes are bit-identical to a whole-tensor evaluation (the
unit tests keep that straightforward version as the oracle).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .scaled_codes import ScaledCodesDecoder
from .blocked_decode import decode_blocks
from .context import check_align, check_chunk, check_input
from .memory import numpy_view
from .bitpack import check_bits, packed_nbytes
from . import cpu_kernels
from .cuda import dispatch as cuda_dispatch
from .hashrng import stream_key
from .qsgd_blocks import chunk_absmax, decode_block, encode_blocks
from .registry import register

__all__ = ["QSGD", "chunk_absmax"]

logger = logging.getLogger(__name__)

#: default elements per scale by bit width (others: 2048); see QSGD's ``chunk``
DEFAULT_CHUNK = {4: 256}


@register("qsgd")
class QSGD(ScaledCodesDecoder):
    """Stochastic b-bit quantization (QSGD-style) with per-chunk scales.

    Args:
        bits: 1, 2, 4 or 8 bits per element on the wire.
        chunk: elements per scale (one fp32 scale per chunk). Default 2048, and 256 for 4 bits:
            4-bit codes are coarse enough that the scale's reach matters. Measured (allgather,
            2 ranks, final loss / dense in the same run): char transformer (AdamW, 300 steps) chunk 64 / 256 / 2048 / 2048-flat =
            1.000 / 1.007 / 1.011 / 1.016; digits MLP and the momentum task within ±0.6% for
            every chunk 32-2048. Wire cost per element: 4 + 32/chunk bits — 64: +12.5% bytes
            over 2048's +0.4%, 256: +3.1%. 256 buys most of the gap for a few percent of
            bytes; ``chunk=64`` when quality matters more than 9% more bytes, 2048 when bytes do.
        align: ``"tensor"`` (default): with the bucket's parameter shapes known, the chunks
            restart at every tensor (:class:`~compressors.scaled_codes.ScaledCodesDecoder`);
            ``"flat"``: chunks of the flat bucket. The ``shared_scale`` algorithm always uses
            flat chunks (its scales are agreed before the integer allreduce).
    """

    _cuda_decompress = cuda_dispatch.qsgd_decompress
    _cuda_decompress_add_ = cuda_dispatch.qsgd_decompress_add_

    name = "qsgd"
    families = ("allgather", "two_phase", "shared_scale")  # shared_scale: comms.algorithms.shared_scale
    unbiased = True

    example_configs = ({"bits": 8}, {"bits": 4}, {"bits": 2})
    # the fewest bits; a chunk that does not divide the block
    edge_configs = ({"bits": 1}, {"bits": 4, "chunk": 7})

    def __init__(self, bits: int = 8, chunk: int | None = None, align: str = "tensor"):
        self.bits = check_bits(bits)
        self.chunk = check_chunk(DEFAULT_CHUNK.get(self.bits, 2048) if chunk is None else chunk)
        self.align = check_align(align)

    def warmup(self, fraction):
        """8 bits for the first half of the warm-up, then these bits."""
        if self.bits >= 8 or fraction >= 0.5:
            return self
        return type(self)(**{**self.config(), "bits": 8})

    @property
    def code_bits(self) -> int:
        return self.bits

    def config(self):
        # align only when not the default: specs and checkpoints written without an align
        # key read the same
        return {"bits": self.bits, "chunk": self.chunk} | ({"align": self.align} if self.align != "tensor" else {})

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def nchunks(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def wire_bytes(self, numel, dtype=torch.float32):
        return 4 * self.nchunks(numel) + packed_nbytes(numel, self.bits)

    def _per_element(self, per_chunk: torch.Tensor, n: int) -> torch.Tensor:
        return per_chunk.repeat_interleave(self.chunk)[:n]

    # -- encode -------------------------------------------------------------------------
    def _compress_flat(self, x, ctx):
        check_input(x)
        # CUDA tensors take the csrc/ kernels when CuPy is there (same bits as this path)
        if x.is_cuda and (out := cuda_dispatch.qsgd_compress(self, x.detach(), ctx)) is not None:
            return out
        x = x.detach().reshape(-1)
        n = x.numel()
        dev = x.device
        s = torch.zeros(self.nchunks(n), dtype=torch.float32, device=dev)
        packed = self.payload_pool().empty(packed_nbytes(n, self.bits), torch.uint8, dev)
        if n == 0:
            return [s, packed]
        key = stream_key(ctx.seed, ctx.step, ctx.bucket, ctx.rank)
        self.block_for(dev)  # validates a user-set block even where the kernel runs
        ck = cpu_kernels.lib(x)
        if ck is not None and x.is_contiguous() and cpu_kernels.dtype_code(x.dtype) is not None:
            # one fused pass per chunk (scale, rounding, codes, packing); same bits as below
            ck.cp_qsgd_encode(x.data_ptr(), cpu_kernels.dtype_code(x.dtype), n, self.chunk,
                              self.bits, key, s.data_ptr(), packed.data_ptr(), cpu_kernels.threads())
            return [s, packed]
        encode_blocks(x, key, s, packed, chunk=self.chunk, bits=self.bits, block=self.block_for(dev),
                      ws=self.workspace())
        # a NaN scale's bits depend on which max/abs kernel met it first (torch's vector max
        # gives 0xFFFFFFFF): one canonical quiet NaN, as the compiled kernel writes
        sn = numpy_view(s)
        if sn is not None:
            sn[np.isnan(sn)] = np.nan
        return [s, packed]

    # -- decode -------------------------------------------------------------------------
    def _steps(self, s: torch.Tensor) -> torch.Tensor:
        # a tensor divisor: torch on CUDA turns `tensor / python_float` into a multiply by the
        # reciprocal (1 ulp off the true quotient the format and the kernels use)
        return torch.div(2 * s, torch.full_like(s, float(self.levels)))

    def _decode(self, payload, ctx, out, accumulate: bool):
        s, packed = payload
        if ctx.numel == 0:
            return out
        ck = cpu_kernels.lib(out, s, packed)
        if (ck is not None and ctx.dtype == torch.float32 and out.dtype == torch.float32
                and s.dtype == torch.float32 and s.is_contiguous() and packed.is_contiguous()
                and out.is_contiguous() and s.numel() >= self.nchunks(ctx.numel)
                and packed.numel() >= packed_nbytes(ctx.numel, self.bits)):
            ck.cp_qsgd_decode(s.data_ptr(), packed.data_ptr(), ctx.numel, self.chunk, self.bits,
                              out.data_ptr(), int(accumulate), cpu_kernels.threads())
            return out
        w = self._steps(s)
        ws = self.workspace()
        return decode_blocks(
            ws, self.block_for(packed.device), ctx, out, accumulate, packed.device,
            lambda b0, b1, f: decode_block(s, w, packed, b0, b1, f, ws, chunk=self.chunk, bits=self.bits))

    def chunk_absmax(self, x: torch.Tensor) -> torch.Tensor:
        """Per-chunk max-abs of flat ``x`` (fp32 bits): the scales (shared_scale family contract)."""
        return chunk_absmax(x, self.chunk)

    def error_bound(self, x):
        """``w = 2s/M`` per element, plus fp32 rounding slack (``s * 2**-19``) and, for
        fp16/bf16 inputs, the rounding of the decoded value to that dtype."""
        s = self.chunk_absmax(x)
        s_el = self._per_element(s, x.numel())
        bound = self._per_element(self._steps(s), x.numel()) + s_el * 2.0 ** -19
        if x.dtype != torch.float32:
            eps = torch.finfo(x.dtype).eps
            bound = (bound + (x.reshape(-1).float().abs() + bound) * eps) * (1 + eps)
        return bound.to(x.dtype).view_as(x)
