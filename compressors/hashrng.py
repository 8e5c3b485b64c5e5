"""Counter-based hash RNG: uniform numbers from (seed, step, bucket, rank, element index).

No RNG state, no global generator: element ``i`` of a stream keyed by ``key`` is
``lowbias32(i ^ key)``. The same arithmetic is written once here in torch int32 ops and
once in ``csrc/`` (CUDA), so stochastic rounding is bit-identical on CPU and GPU.

Spec (shared with the CUDA kernels — change both or neither):

* ``lowbias32(x)`` on uint32: ``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15;
  x *= 0x846ca68b; x ^= x >> 16`` (wrapping multiplies).
* ``stream_key(seed, step, bucket, rank)`` folds the four integers with ``lowbias32``
  (see :func:`stream_key`); ``rank=SHARED`` gives a stream every rank agrees on.
* ``uniform``: ``u = ((h >> 8) + 0.5) * 2**-24`` in fp32, i.e. in (0, 1), exactly
  representable, never 0 or 1.
"""

from __future__ import annotations

import logging

import torch

__all__ = [
    "SHARED",
    "lowbias32_int",
    "stream_key",
    "hash_u32",
    "uniform",
    "uniform_into",
]

logger = logging.getLogger(__name__)

SHARED = -1  # rank value meaning "the stream every rank shares"

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
# int32 views of the multipliers (torch int32 multiplication wraps like uint32 modulo 2**32)
_C1_I32 = _C1
_C2_I32 = _C2 - (1 << 32)


def lowbias32_int(x: int) -> int:
    """``lowbias32`` on a Python int (for keys, computed on the host once per call)."""
    x &= _M32
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    x ^= x >> 16
    return x


def stream_key(seed: int, step: int, bucket: int, rank: int = SHARED) -> int:
    """Fold (seed, step, bucket, rank) into one 32-bit key. Pure host arithmetic."""
    k = lowbias32_int(seed ^ 0x5BD1E995)
    k = lowbias32_int(k ^ (step & _M32))
    k = lowbias32_int(k ^ ((step >> 32) & _M32) ^ 0x27D4EB2F)
    k = lowbias32_int(k ^ (bucket & _M32))
    k = lowbias32_int(k ^ ((rank + 1) & _M32))
    return k


def _as_i32(key: int) -> int:
    key &= _M32
    return key - (1 << 32) if key >= (1 << 31) else key


def _mix_inplace(h: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on an int32 tensor (logical shifts via mask after arithmetic shift)."""
    torch.bitwise_right_shift(h, 16, out=tmp)
    tmp.bitwise_and_(0xFFFF)
    h.bitwise_xor_(tmp)
    h.mul_(_C1_I32)
    torch.bitwise_right_shift(h, 15, out=tmp)
    tmp.bitwise_and_(0x1FFFF)
    h.bitwise_xor_(tmp)
    h.mul_(_C2_I32)
    torch.bitwise_right_shift(h, 16, out=tmp)
    tmp.bitwise_and_(0xFFFF)
    h.bitwise_xor_(tmp)
    return h


def hash_u32(start: int, n: int, key: int, device=None, out: torch.Tensor | None = None,
             tmp: torch.Tensor | None = None) -> torch.Tensor:
    """``lowbias32(i ^ key)`` for ``i`` in ``[start, start + n)`` as int32 bit patterns."""
    if out is None:
        out = torch.empty(n, dtype=torch.int32, device=device)
    if tmp is None:
        tmp = torch.empty_like(out)
    torch.arange(start, start + n, dtype=torch.int32, device=out.device, out=out)
    out.bitwise_xor_(_as_i32(key))
    return _mix_inplace(out, tmp)


_SCALE = 2.0 ** -24


def uniform_into(out: torch.Tensor, start: int, key: int, ibuf: torch.Tensor | None = None,
                 tmp: torch.Tensor | None = None) -> torch.Tensor:
    """Fill fp32 ``out`` with u in (0, 1) for indices ``[start, start + out.numel())``."""
    n = out.numel()
    h = hash_u32(start, n, key, device=out.device, out=ibuf, tmp=tmp)
    torch.bitwise_right_shift(h, 8, out=h)
    h.bitwise_and_(0xFFFFFF)
    out.copy_(h)  # exact: < 2**24
    out.add_(0.5).mul_(_SCALE)
    return out


def uniform(n: int, key: int, device=None, start: int = 0) -> torch.Tensor:
    """A fresh fp32 tensor of ``n`` uniforms in (0, 1) from the stream ``key``."""
    out = torch.empty(n, dtype=torch.float32, device=device)
    return uniform_into(out, start, key)
