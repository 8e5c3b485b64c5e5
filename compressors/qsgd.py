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

Implementation: the input is processed in cache-sized blocks (:func:`block_elems`) with
scratch buffers reused across calls; each block's ops are the reference ops above, one rounded
fp32 op at a time, so the codes are bit-identical to a whole-tensor evaluation (the unit tests
keep that straightforward version as the oracle).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .scaled_codes import ScaledCodesDecoder
from .context import check_align, check_chunk, check_input
from .memory import chunk_pieces, numpy_view
from .bitpack import check_bits, pack, packed_nbytes, unpack
from . import cpu_kernels
from .cuda import dispatch as cuda_dispatch
from .hashrng import add_uniform_, stream_key
from .registry import register

__all__ = ["QSGD", "chunk_absmax"]

logger = logging.getLogger(__name__)

#: default elements per scale by bit width (others: 2048); see QSGD's ``chunk``
DEFAULT_CHUNK = {4: 256}
_CPU_BLOCK = 1 << 19


def _absmax_fold_(x: torch.Tensor, b0: int, b1: int, chunk: int, s: torch.Tensor) -> None:
    """``s[c] = max(s[c], max|x|)`` over the chunks overlapping ``[b0, b1)``.

    ``max|x| = max(max x, -min x)`` read-only (no abs pass); max is exact, so folding pieces
    gives the bits of ``amax(x.float().abs())``; ``abs_`` turns a -0.0 into +0.0 (and clears
    a NaN's sign, as abs does).
    """
    for lo, hi, ci, rows in chunk_pieces(b0, b1, chunk):
        if rows:
            xs = x[lo:hi].view(rows, chunk)
            hi_, lo_ = torch.amax(xs, dim=1), torch.amin(xs, dim=1)
            sl = s[ci:ci + rows]
        else:
            xs = x[lo:hi]
            hi_, lo_ = torch.amax(xs, dim=0, keepdim=True), torch.amin(xs, dim=0, keepdim=True)
            sl = s[ci:ci + 1]
        sn = numpy_view(sl)
        if sn is not None and hi_.dtype == torch.float32:  # tiny ops: numpy calls are cheaper
            hn, ln = hi_.numpy(), lo_.numpy()
            np.negative(ln, out=ln)
            np.maximum(hn, ln, out=hn)
            np.maximum(sn, hn, out=sn)
            np.abs(sn, out=sn)
        else:
            m = torch.maximum(hi_, lo_.neg_())
            torch.maximum(sl, m, out=sl).abs_()


def chunk_absmax(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """fp32 max|x| per chunk of ``chunk`` elements (last chunk may be short).

    Blocked (no input-sized temporary); max is exact, so the bits equal
    ``amax(x.float().abs().view(-1, chunk), 1)``.
    """
    x = x.reshape(-1)
    n = x.numel()
    nch = -(-n // chunk)
    out = torch.zeros(nch, dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    for b0 in range(0, n, _CPU_BLOCK):
        _absmax_fold_(x, b0, min(n, b0 + _CPU_BLOCK), chunk, out)
    return out


def _to_codes(t: torch.Tensor, h: torch.Tensor, codes: torch.Tensor) -> None:
    """uint8 ``codes = t`` for fp32 ``t`` already clamped to [0, M] (or NaN -> 0).

    Truncation equals floor there. torch's fp32 -> uint8 copy is slow on CPU (per 25M values:
    13 ms, numpy's cast 2 ms, torch's fp32 -> int32 -> uint8 4 ms), so numpy's cast is used
    (torch's fp32 -> int32 -> uint8 where numpy cannot); all give 0 for NaN (checked at
    import; otherwise the torch route is used).
    """
    if _NP_CAST_OK and t.device.type == "cpu":
        with np.errstate(invalid="ignore"):
            np.copyto(codes.numpy(), t.numpy(), casting="unsafe")
    else:
        h.copy_(t)
        codes.copy_(h)


def _np_cast_ok() -> bool:
    v = np.array([np.nan, -np.nan, 0.0, 0.99, 1.0, 254.99, 255.0] * 37, dtype=np.float32)
    out = np.empty(v.shape, np.uint8)
    with np.errstate(invalid="ignore"):
        np.copyto(out, v, casting="unsafe")
    ref = torch.from_numpy(v).to(torch.int32).to(torch.uint8).numpy()
    return bool((out == ref).all())


_NP_CAST_OK = _np_cast_ok()


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

    @classmethod
    def examples(cls):
        return [cls(8), cls(4), cls(2)]

    @classmethod
    def edge_examples(cls):  # the fewest bits; a chunk that does not divide the block
        return [cls(1), cls(4, chunk=7)]

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
        self._encode_blocks(x, key, s, packed)
        # a NaN scale's bits depend on which max/abs kernel met it first (torch's vector max
        # gives 0xFFFFFFFF): one canonical quiet NaN, as the compiled kernel writes
        sn = numpy_view(s)
        if sn is not None:
            sn[np.isnan(sn)] = np.nan
        return [s, packed]

    def _encode_blocks(self, x, key: int, s: torch.Tensor, packed: torch.Tensor) -> None:
        """The torch encode of flat ``x`` (no compiled kernel): scales into ``s``, packed codes
        into ``packed``, block by block over reused scratch buffers."""
        n, dev, c = x.numel(), x.device, self.chunk
        half = torch.tensor(self.levels * 0.5, dtype=torch.float32)
        B = self.block_for(dev)
        cap = min(B, n)
        ws = self.workspace()
        r = torch.empty(s.numel(), dtype=torch.float32, device=dev)
        # each block holds whole chunks when the chunk divides the (aligned) block: one pass
        fused = B % c == 0
        if not fused:
            for b0 in range(0, n, B):
                _absmax_fold_(x, b0, min(n, b0 + B), c, s)
            self._inv_scale(s, half, r)
        for b0 in range(0, n, B):
            b1 = min(n, b0 + B)
            if fused:
                _absmax_fold_(x, b0, b1, c, s)
                ci0, ci1 = b0 // c, -(-b1 // c)
                self._inv_scale(s[ci0:ci1], half, r[ci0:ci1])
            self._encode_block(x, b0, b1, r, half, key, packed, ws, cap)

    def _encode_block(self, x, b0: int, b1: int, r, half, key: int, packed, ws, cap: int) -> None:
        """Codes of elements ``[b0, b1)`` (``r``: the inverse scales) into ``packed``."""
        c, bits, dev, L = self.chunk, self.bits, x.device, b1 - b0
        tb = ws.get("t", cap, torch.float32, dev)[:L]
        tmp = ws.get("tmp", cap, torch.int32, dev)
        v = tmp.view(torch.float32)  # u's fp32 values reuse tmp once the hash is done
        # t = fl(x * r) per chunk, then fl(t + M/2), then fl(t + u)
        for lo, hi, ci, rows in chunk_pieces(b0, b1, c):
            xs, ts = x[lo:hi], tb[lo - b0:hi - b0]
            rs = r[ci]
            if rows:
                xs, ts, rs = xs.view(rows, c), ts.view(rows, c), r[ci:ci + rows].unsqueeze(1)
            if x.dtype == torch.float32:
                torch.mul(xs, rs, out=ts)
            else:  # exact widening first, so the product is an fp32 product
                ts.copy_(xs).mul_(rs)
        tb.add_(half)
        hb = ws.get("h", cap, torch.int32, dev)[:L]
        add_uniform_(tb, b0, key, hb, tmp[:L], v[:L], ws.iota(min(self.block_for(dev), 1 << 16), dev))
        # q = clamp(floor(t), 0, M): clamping first and then truncating toward zero (the
        # float -> integer cast) gives the same integers, as t > -1 always
        tb.clamp_(0, self.levels)
        codes = packed[b0:b1] if bits == 8 else ws.get("codes", cap, torch.uint8, dev)[:L]
        _to_codes(tb, hb, codes)
        if bits != 8:
            nb0 = b0 * bits // 8  # b0 is a multiple of 8 (B is)
            pack(codes, bits, out=packed[nb0:nb0 + packed_nbytes(L, bits)], ws=ws)

    @staticmethod
    def _inv_scale(s: torch.Tensor, half: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``r = fp32(M/2) / s`` where ``s > 0``, else 0 (also for NaN)."""
        sn, on = numpy_view(s), numpy_view(out)
        if sn is not None and on is not None:  # tiny ops: numpy calls are cheaper
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                np.divide(np.float32(half.item()), sn, out=on)
            on[~(sn > 0)] = 0.0
            return out
        torch.div(half, s, out=out)
        # not where(s > 0, out, cpu_zero): the bound must live on out's device (CUDA)
        return out.masked_fill_(~(s > 0), 0.0)

    # -- decode -------------------------------------------------------------------------
    def _steps(self, s: torch.Tensor) -> torch.Tensor:
        # a tensor divisor: torch on CUDA turns `tensor / python_float` into a multiply by the
        # reciprocal (1 ulp off the true quotient the format and the kernels use)
        return torch.div(2 * s, torch.full_like(s, float(self.levels)))

    def _decode_block(self, s, w, packed, b0, b1, f, ws):
        """fp32 decode of elements ``[b0, b1)`` into ``f`` (fp32, ``b1 - b0``)."""
        c, bits = self.chunk, self.bits
        L = b1 - b0
        if bits == 8:
            f.copy_(packed[b0:b1])
        else:
            q = ws.get("codes", L, torch.uint8, f.device)
            nb0 = b0 * bits // 8
            unpack(packed[nb0:nb0 + packed_nbytes(L, bits)], bits, L, out=q, ws=ws)
            f.copy_(q)
        for lo, hi, ci, rows in chunk_pieces(b0, b1, c):
            fs = f[lo - b0:hi - b0]
            if rows:
                fs = fs.view(rows, c)
                fs.mul_(w[ci:ci + rows].unsqueeze(1)).sub_(s[ci:ci + rows].unsqueeze(1))
            else:
                fs.mul_(w[ci]).sub_(s[ci])
        return f

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
        return self._decode_blocks(
            ctx, out, accumulate, packed.device,
            lambda b0, b1, f: self._decode_block(s, w, packed, b0, b1, f, ws))

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
