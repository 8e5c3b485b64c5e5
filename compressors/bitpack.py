"""Pack and unpack unsigned ``bits``-wide codes (1, 2, 4 or 8) into uint8.

Layout (shared with csrc/pack.cu): code ``i`` lives in byte ``i * bits // 8`` at bit offset
``(i * bits) % 8``, least significant bits first; the tail of the last byte is zero.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["VALID_BITS", "check_bits", "packed_nbytes", "pack", "unpack"]

logger = logging.getLogger(__name__)

VALID_BITS = (1, 2, 4, 8)


def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int in {VALID_BITS}, got {bits!r}")
    if bits not in VALID_BITS:
        raise ValueError(f"bits must be one of {VALID_BITS}, got {bits!r}")
    return bits


def packed_nbytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack uint8 ``codes`` (each < 2**bits) into ``packed_nbytes(n, bits)`` bytes."""
    check_bits(bits)
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if bits == 8:
        return out.copy_(codes.reshape(-1))
    per = 8 // bits
    full = n // per
    flat = codes.reshape(-1)
    if full:
        body = flat[: full * per].view(full, per)
        acc = out[:full]
        acc.copy_(body[:, 0])
        for j in range(1, per):
            acc.bitwise_or_(body[:, j] << (j * bits))
    rem = n - full * per
    if rem:
        tail = torch.zeros(per, dtype=torch.uint8, device=codes.device)
        tail[:rem] = flat[full * per:]
        v = tail[0].clone()
        for j in range(1, per):
            v |= tail[j] << (j * bits)
        out[full] = v
    return out


def unpack(packed: torch.Tensor, bits: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`pack`: ``n`` uint8 codes."""
    check_bits(bits)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    if bits == 8:
        return out.copy_(packed[:n])
    per = 8 // bits
    mask = (1 << bits) - 1
    nbytes = packed_nbytes(n, bits)
    full = n // per
    src = packed[:nbytes]
    if full:
        body = out[: full * per].view(full, per)
        for j in range(per):
            torch.bitwise_right_shift(src[:full], j * bits, out=body[:, j])
        body.bitwise_and_(mask)
    rem = n - full * per
    if rem:
        last = src[full]
        for j in range(rem):
            out[full * per + j] = (last >> (j * bits)) & mask
    return out
