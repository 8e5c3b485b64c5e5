"""``ScaledSign``: 1 bit per element (the sign), times the chunk's mean |x| (signSGD/EF-SGD).

Format (shared with csrc/): bit 1 for ``x >= 0``, 0 otherwise; per chunk scale
``s = mean|x|`` over the chunk's real elements; decode ``x' = +s`` or ``-s``.
Payload: ``[scales (nchunks, fp32), bits (ceil(n/8), uint8)]``. Biased: use error feedback.

The scale is ``torch.mean`` of the fp32 ``|x|`` of each chunk: whole chunks as rows of a
``(rows, chunk)`` view reduced over dim 1, the short last chunk as a 1-D mean. Its fp32 bits
depend on torch's summation order, which the format does not pin down, so another
implementation (csrc/) should take the scales from this torch code rather than recompute
them. The blocked fast path below keeps the bits of the whole-tensor version (tested): on CPU
each row is summed by one thread with the same vectorized loop whatever the number of rows,
as long as a single-row reduction stays below torch's 32768-element parallel grain (a
one-output reduction above it is split across threads); elsewhere the scales are computed
with the whole-tensor ops.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .scaled_codes import ScaledCodesDecoder
from .context import check_align, check_chunk, check_input
from .memory import chunk_pieces, numpy_view
from .bitpack import pack, packed_nbytes, unpack
from .blocked_decode import decode_blocks
from . import cpu_kernels
from .cuda import dispatch as cuda_dispatch
from .registry import register

__all__ = ["ScaledSign"]

logger = logging.getLogger(__name__)

_GRAIN = 32768  # at::internal::GRAIN_SIZE: one-output reductions above it split across threads


def _canonical_nan_(s: torch.Tensor) -> None:
    """NaN scales as the one quiet NaN 0x7FC00000 (a NaN's bits after torch's sum depend on
    the kernel that met it; the compiled kernel writes this one)."""
    sn = numpy_view(s)
    if sn is not None:
        sn[np.isnan(sn)] = np.nan


_LANES_OK: dict = {}


def _kernel_lanes(ck, chunk: int):
    """The fp32 vector width (8 or 16) at which the compiled scales match torch's ``mean`` bits
    for rows of ``chunk``, else None (torch computes them). Checked once per chunk size on a few
    rows and a short tail, each width in turn: the sum's order is torch's, which the format does
    not pin down, and it follows the width of the kernel torch dispatched for ``sum``, not the
    CPU's capability (torch 2.13 on an AVX-512 Xeon reports ``AVX512`` and sums in 8 lanes)."""
    ok = _LANES_OK.get(chunk)
    if ok is None:
        g = torch.Generator().manual_seed(chunk)
        n = 3 * chunk + max(1, chunk // 2 + 1)
        x = torch.randn(n, generator=g) * torch.exp(4 * torch.randn(n, generator=g))
        want = ScaledSign(chunk, align="flat")._scales(x)
        got = torch.empty_like(want)
        bits = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8)
        ok = 0
        for lanes in cpu_kernels.SUM_LANES:
            ck.cp_sign_encode(x.data_ptr(), 0, n, chunk, lanes, got.data_ptr(), bits.data_ptr(), 1)
            if torch.equal(got.view(torch.int32), want.view(torch.int32)):
                ok = lanes
                break
        if not ok:
            logger.debug("sign scales: compiled sum differs from torch's for chunk %d", chunk)
        _LANES_OK[chunk] = ok
    return ok or None


@register("sign", "scaledsign", "signsgd")
class ScaledSign(ScaledCodesDecoder):
    """Scaled sign compression.

    Args:
        chunk: elements per scale.
        align: ``"tensor"`` (default): when the hook passes the bucket's parameter shapes, the
            chunks restart at every tensor, so no scale mixes two tensors
            (:class:`~compressors.scaled_codes.ScaledCodesDecoder`); ``"flat"``: chunks of the flat
            bucket. Costs at most one extra fp32 scale per tensor.
    """

    _cuda_decompress = cuda_dispatch.sign_decompress
    _cuda_decompress_add_ = cuda_dispatch.sign_decompress_add_

    name = "sign"
    families = ("allgather", "two_phase")

    edge_configs = ({"chunk": 5},)  # a chunk that does not divide the block

    # 128: one scale per 128 signs (1.25 bits/element). On the digits MLP (bench/demo.py, 2
    # ranks, 600 steps, SGD momentum 0.9) chunk 64/128/256/512/2048 reached 0.80/1.08/2.2/5.9/50x
    # dense's final loss: coarse scales that straddle layers are what makes sign + EF lag.
    code_bits = 1

    def __init__(self, chunk: int = 128, align: str = "tensor"):
        self.chunk = check_chunk(chunk)
        self.align = check_align(align)

    def config(self):
        # align only when not the default: specs and checkpoints written without an align
        # key read the same
        return {"chunk": self.chunk} | ({"align": self.align} if self.align != "tensor" else {})

    def nchunks(self, numel):
        return -(-numel // self.chunk)

    def wire_bytes(self, numel, dtype=torch.float32):
        return 4 * self.nchunks(numel) + packed_nbytes(numel, 1)

    def _scales(self, xf: torch.Tensor) -> torch.Tensor:
        """Whole-tensor reference scales (fp32 ``xf``)."""
        n = xf.numel()
        c = self.chunk
        nfull = n // c
        nch = self.nchunks(n)
        s = torch.empty(nch, dtype=torch.float32, device=xf.device)
        if nfull:
            torch.mean(xf[: nfull * c].view(nfull, c).abs(), dim=1, out=s[:nfull])
        if nch > nfull:
            s[nfull] = xf[nfull * c:].abs().mean()
        return s

    @staticmethod
    def _abs_into(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return torch.abs(x, out=t)
        return t.copy_(x).abs_()

    def _scales_blocked(self, x: torch.Tensor, s: torch.Tensor, B: int) -> None:
        """Same bits as :meth:`_scales` without an input-sized temporary (CPU): whole chunks
        in groups of >= 2 rows (1 only when the tensor has a single whole chunk, as in the
        whole-tensor version), each group's |x| in a reused buffer."""
        n, c = x.numel(), self.chunk
        nfull = n // c
        ws = self.workspace()
        if nfull:
            g = 1 if nfull == 1 else max(2, B // c)
            starts = list(range(0, nfull, g))
            if len(starts) > 1 and nfull - starts[-1] == 1:
                starts.pop()  # never leave a single-row group behind
            bounds = starts[1:] + [nfull]
            for r0, r1 in zip(starts, bounds):
                t = ws.get("abs", (r1 - r0) * c, torch.float32, x.device)
                self._abs_into(x[r0 * c:r1 * c], t)
                torch.mean(t.view(r1 - r0, c), dim=1, out=s[r0:r1])
        if n > nfull * c:
            t = ws.get("abs", n - nfull * c, torch.float32, x.device)
            s[nfull] = self._abs_into(x[nfull * c:], t).mean()

    def _compress_flat(self, x, ctx):
        check_input(x)
        # CUDA tensors take the csrc/ kernels when CuPy is there (same bits as this path)
        if x.is_cuda and (out := cuda_dispatch.sign_compress(self, x.detach(), ctx)) is not None:
            return out
        x = x.detach().reshape(-1)
        n, c, dev = x.numel(), self.chunk, x.device
        s = torch.empty(self.nchunks(n), dtype=torch.float32, device=dev)
        packed = self.payload_pool().empty(packed_nbytes(n, 1), torch.uint8, dev)
        if n == 0:
            return [s, packed]
        B = self.block_for(dev)
        ck = cpu_kernels.lib(x)
        dt = cpu_kernels.dtype_code(x.dtype)
        if ck is not None and dt is not None and x.is_contiguous():
            # one pass: per-chunk scales in torch's summation order (when the self-check
            # says the kernel reproduces it for this chunk; else torch's), and the bits
            lanes = _kernel_lanes(ck, c) if c < _GRAIN else None
            if lanes is None:
                self._scales_blocked(x, s, B)
                _canonical_nan_(s)
            ck.cp_sign_encode(x.data_ptr(), dt, n, c, lanes or 8,
                              None if lanes is None else s.data_ptr(), packed.data_ptr(),
                              cpu_kernels.threads())
            return [s, packed]
        cap = min(B, n)
        ws = self.workspace()
        # CPU: each block holds whole chunks and a single row stays below the parallel grain,
        # so block-wise means have the whole-tensor bits (see the module docstring)
        fused = dev.type == "cpu" and B % c == 0 and c < _GRAIN
        if not fused:
            if dev.type == "cpu":
                self._scales_blocked(x, s, B)
            else:
                s.copy_(self._scales(x.float()))
        bits = ws.get("bits", cap, torch.bool, dev)
        for b0 in range(0, n, B):
            b1 = min(n, b0 + B)
            L = b1 - b0
            if fused:
                t = self._abs_into(x[b0:b1], ws.get("t", cap, torch.float32, dev)[:L])
                for lo, hi, ci, rows in chunk_pieces(b0, b1, c):
                    if rows:
                        torch.mean(t[lo - b0:hi - b0].view(rows, c), dim=1, out=s[ci:ci + rows])
                    else:  # the short last chunk
                        s[ci] = t[lo - b0:hi - b0].mean()
            bb = bits[:L]
            xn = numpy_view(x[b0:b1])
            if xn is not None:  # numpy's compare is much faster than torch's on CPU
                np.greater_equal(xn, 0, out=numpy_view(bb))
            else:
                torch.ge(x[b0:b1], 0, out=bb)
            pack(bb, 1, out=packed[b0 // 8:b0 // 8 + packed_nbytes(L, 1)], ws=ws)
        _canonical_nan_(s)
        return [s, packed]

    def _decode(self, payload, ctx, out, accumulate):
        s, packed = payload
        if ctx.numel == 0:
            return out
        c = self.chunk
        ck = cpu_kernels.lib(out, s, packed)
        if (ck is not None and ctx.dtype == torch.float32 and out.dtype == torch.float32
                and s.dtype == torch.float32 and s.is_contiguous() and packed.is_contiguous()
                and out.is_contiguous() and s.numel() >= self.nchunks(ctx.numel)
                and packed.numel() >= packed_nbytes(ctx.numel, 1)):
            ck.cp_sign_decode(s.data_ptr(), packed.data_ptr(), ctx.numel, c, out.data_ptr(),
                              int(accumulate), cpu_kernels.threads())
            return out
        ws = self.workspace()

        def block(b0, b1, f):  # the reference's ops: ((2 * b) - 1) * s
            L = b1 - b0
            q = ws.get("q", L, torch.uint8, f.device)
            unpack(packed[b0 // 8:b0 // 8 + packed_nbytes(L, 1)], 1, L, out=q, ws=ws)
            f.copy_(q).mul_(2).sub_(1)
            for lo, hi, ci, rows in chunk_pieces(b0, b1, c):
                fs = f[lo - b0:hi - b0]
                if rows:
                    fs.view(rows, c).mul_(s[ci:ci + rows].unsqueeze(1))
                else:
                    fs.mul_(s[ci])

        return decode_blocks(ws, self.block_for(packed.device), ctx, out, accumulate, packed.device, block)

    def error_bound(self, x):
        """``|x| + s`` per element (plus the rounding of the decoded value for fp16/bf16)."""
        xf = x.reshape(-1).float()
        s = self._scales(xf).repeat_interleave(self.chunk)[: x.numel()]
        bound = xf.abs() + s
        if x.dtype != torch.float32:
            eps = torch.finfo(x.dtype).eps
            bound = bound * (1 + 2 * eps)
        return bound.to(x.dtype).view_as(x)
