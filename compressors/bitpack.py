"""Pack and unpack unsigned ``bits``-wide codes (1, 2, 4 or 8) into uint8.

Layout (shared with csrc/pack.cu): code ``i`` lives in byte ``i * bits // 8`` at bit offset
``(i * bits) % 8``, least significant bits first; the tail of the last byte is zero.

Codes must be < ``2**bits`` (other values give unspecified bytes). The implementation works
on whole bytes at once: the ``8 // bits`` codes of one output byte are read as one wider
little-endian integer (int16/int32/int64) and gathered with a shift-or or with one wrapping
multiply whose partial products never overlap (so no carries), e.g. for ``bits=1`` the eight
0/1 bytes ``b_j`` of an int64 ``v`` give ``(v * 0x0102040810204080) >> 56 == sum b_j << j``.
"""

from __future__ import annotations

import logging
import sys

import torch

__all__ = ["VALID_BITS", "check_bits", "packed_nbytes", "pack", "unpack"]

logger = logging.getLogger(__name__)

VALID_BITS = (1, 2, 4, 8)

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("compressors.bitpack assumes a little-endian host")

_WIDE = {4: torch.int16, 2: torch.int32, 1: torch.int64}  # one output byte's codes as one int

# pack: gather the codes of one wide int into its top byte (partial products never overlap)
_PACK2_MUL = torch.tensor(0x01041040, dtype=torch.int32)  # c_j << 8j  ->  c_j << (24 + 2j)
_PACK1_MUL = torch.tensor(0x0102040810204080, dtype=torch.int64)  # b_j << 8j -> b_j << (56 + j)
_SH4 = torch.tensor(4, dtype=torch.int16)
_SH24 = torch.tensor(24, dtype=torch.int32)
_SH56 = torch.tensor(56, dtype=torch.int64)
# unpack
_SH6 = torch.tensor(6, dtype=torch.int32)
_SH12 = torch.tensor(12, dtype=torch.int32)
_MASK4 = torch.tensor(0x0F0F, dtype=torch.int16)
_MASK2 = torch.tensor(0x03030303, dtype=torch.int32)
_SPREAD1 = torch.tensor(0x0101010101010101, dtype=torch.int64)  # p -> p in every byte
_MASK1 = torch.tensor(0x8040201008040201 - (1 << 64), dtype=torch.int64)  # byte j keeps bit j


def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int in {VALID_BITS}, got {bits!r}")
    if bits not in VALID_BITS:
        raise ValueError(f"bits must be one of {VALID_BITS}, got {bits!r}")
    return bits


def packed_nbytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def _wide_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` (contiguous uint8) reinterpreted as ``dtype``, or None when misaligned."""
    size = dtype.itemsize
    if t.numel() % size or t.storage_offset() % size or t.data_ptr() % size:
        return None
    return t.view(dtype)


def _scratch(ws, name: str, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    if ws is None:
        return torch.empty(n, dtype=dtype, device=device)
    return ws.get(name, n, dtype, device)


def pack(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None, ws=None) -> torch.Tensor:
    """Pack uint8 (or bool) ``codes`` (each < 2**bits) into ``packed_nbytes(n, bits)`` bytes.

    ``ws`` (optional) is a :class:`compressors.base.Workspace` for the scratch buffers.
    """
    check_bits(bits)
    flat = codes.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    n = flat.numel()
    nbytes = packed_nbytes(n, bits)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if bits == 8:
        return out.copy_(flat)
    per = 8 // bits
    full = n // per
    if full:
        body = flat[: full * per]
        wdt = _WIDE[bits]
        v = _wide_view(body, wdt)
        if v is None:
            v = _scratch(ws, "pack.in", full * per, torch.uint8, body.device)
            v = v.copy_(body).view(wdt)
        t = _scratch(ws, "pack.tmp", full, wdt, body.device)
        if bits == 4:  # c0 | c1 << 8  ->  low byte c0 | c1 << 4
            torch.bitwise_right_shift(v, _SH4, out=t)
            t.bitwise_or_(v)
        elif bits == 2:
            torch.mul(v, _PACK2_MUL, out=t)
            t.bitwise_right_shift_(_SH24)
        else:
            torch.mul(v, _PACK1_MUL, out=t)
            t.bitwise_right_shift_(_SH56)
        out[:full].copy_(t)  # integer -> uint8 keeps the low byte
    rem = n - full * per
    if rem:
        tail = flat[full * per:].to(torch.int32)
        shifts = torch.arange(rem, dtype=torch.int32, device=tail.device) * bits
        out[full:full + 1].copy_(torch.bitwise_left_shift(tail, shifts).sum(0, keepdim=True))
    return out


def unpack(packed: torch.Tensor, bits: int, n: int, out: torch.Tensor | None = None,
           ws=None) -> torch.Tensor:
    """Inverse of :func:`pack`: ``n`` uint8 codes (into ``out`` when given)."""
    check_bits(bits)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    if bits == 8:
        return out.copy_(packed[:n])
    per = 8 // bits
    mask = (1 << bits) - 1
    full = n // per
    src = packed[:packed_nbytes(n, bits)]
    if full:
        wdt = _WIDE[bits]
        dst = out[: full * per]
        o = _wide_view(dst, wdt)
        if o is None:
            o = _scratch(ws, "unpack.out", full, wdt, packed.device)
        if bits == 4:  # p -> (p | p << 4) & 0x0F0F: bytes (p & 15, p >> 4)
            w = _scratch(ws, "unpack.tmp", full, wdt, packed.device)
            w.copy_(src[:full])
            torch.bitwise_left_shift(w, _SH4, out=o)
            o.bitwise_or_(w).bitwise_and_(_MASK4)
        elif bits == 2:  # shifts of 6 then 12 put code j at bit 8j; or-ing never carries
            w = _scratch(ws, "unpack.tmp", full, wdt, packed.device)
            w.copy_(src[:full])
            torch.bitwise_left_shift(w, _SH6, out=o)
            o.bitwise_or_(w)
            torch.bitwise_left_shift(o, _SH12, out=w)
            o.bitwise_or_(w).bitwise_and_(_MASK2)
        else:  # p copied into all 8 bytes (no carries), byte j keeps bit j, then != 0
            o.copy_(src[:full])
            o.mul_(_SPREAD1).bitwise_and_(_MASK1)
        ob = o.view(torch.uint8)
        if bits == 1:
            ob.clamp_max_(1)  # a Python bound: clamp takes no CPU tensor bound on CUDA
        if ob.data_ptr() != dst.data_ptr():
            dst.copy_(ob)
    rem = n - full * per
    if rem:
        shifts = torch.arange(rem, dtype=torch.int32, device=packed.device) * bits
        last = src[full:full + 1].to(torch.int32)
        out[full * per:].copy_(torch.bitwise_right_shift(last, shifts).bitwise_and_(mask))
    return out
