"""QSGD's torch path, block by block: per-chunk scales, the encode and the decode of one block.

What runs where the compiled kernels (csrc/cpu, csrc/quantize.cu) do not: the format's
reference ops (:mod:`compressors.qsgd`), one rounded fp32 op at a time, over cache-sized blocks
and scratch buffers reused across calls, so the codes are bit-identical to a whole-tensor
evaluation and to the kernels (the unit tests keep the straightforward version as the oracle).
"""

from __future__ import annotations

import numpy as np
import torch

from .bitpack import pack, packed_nbytes, unpack
from .hashrng import add_uniform_
from .memory import Workspace, chunk_pieces, numpy_view

__all__ = ["chunk_absmax", "absmax_fold_", "inv_scale", "encode_blocks", "encode_block", "decode_block"]

_CPU_BLOCK = 1 << 19


def absmax_fold_(x: torch.Tensor, b0: int, b1: int, chunk: int, s: torch.Tensor) -> None:
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
        absmax_fold_(x, b0, min(n, b0 + _CPU_BLOCK), chunk, out)
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


def inv_scale(s: torch.Tensor, half: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
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


def encode_blocks(x, key: int, s: torch.Tensor, packed: torch.Tensor, *, chunk: int, bits: int,
                  block: int, ws: Workspace) -> None:
    """The torch encode of flat ``x`` (no compiled kernel): scales into ``s``, packed codes
    into ``packed``, block by block (``block`` elements) over ``ws``'s reused scratch."""
    n, dev, c = x.numel(), x.device, chunk
    half = torch.tensor(((1 << bits) - 1) * 0.5, dtype=torch.float32)
    cap = min(block, n)
    r = torch.empty(s.numel(), dtype=torch.float32, device=dev)
    # each block holds whole chunks when the chunk divides the (aligned) block: one pass
    fused = block % c == 0
    if not fused:
        for b0 in range(0, n, block):
            absmax_fold_(x, b0, min(n, b0 + block), c, s)
        inv_scale(s, half, r)
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        if fused:
            absmax_fold_(x, b0, b1, c, s)
            ci0, ci1 = b0 // c, -(-b1 // c)
            inv_scale(s[ci0:ci1], half, r[ci0:ci1])
        encode_block(x, b0, b1, r, half, key, packed, ws, cap, chunk=c, bits=bits, block=block)


def encode_block(x, b0: int, b1: int, r, half, key: int, packed, ws: Workspace, cap: int, *,
                 chunk: int, bits: int, block: int) -> None:
    """Codes of elements ``[b0, b1)`` (``r``: the inverse scales) into ``packed``."""
    c, dev, L = chunk, x.device, b1 - b0
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
    add_uniform_(tb, b0, key, hb, tmp[:L], v[:L], ws.iota(min(block, 1 << 16), dev))
    # q = clamp(floor(t), 0, M): clamping first and then truncating toward zero (the
    # float -> integer cast) gives the same integers, as t > -1 always
    tb.clamp_(0, (1 << bits) - 1)
    codes = packed[b0:b1] if bits == 8 else ws.get("codes", cap, torch.uint8, dev)[:L]
    _to_codes(tb, hb, codes)
    if bits != 8:
        nb0 = b0 * bits // 8  # b0 is a multiple of 8 (the block is)
        pack(codes, bits, out=packed[nb0:nb0 + packed_nbytes(L, bits)], ws=ws)


def decode_block(s, w, packed, b0: int, b1: int, f, ws: Workspace, *, chunk: int, bits: int):
    """fp32 decode of elements ``[b0, b1)`` into ``f`` (fp32, ``b1 - b0``): ``s`` the scales,
    ``w`` the steps ``2s/M`` per chunk."""
    c, L = chunk, b1 - b0
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
