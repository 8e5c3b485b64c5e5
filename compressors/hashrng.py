"""Counter-based hash RNG: uniform numbers from (seed, step, bucket, rank, element index).

No RNG state, no global generator: element ``i`` of a stream keyed by ``key`` is
``lowbias32(i ^ key)``. The same arithmetic is written once here in torch int32 ops and
once in ``csrc/`` (CUDA), so stochastic rounding is bit-identical on CPU and GPU.

Spec (shared with the CUDA kernels — change both or neither):

* ``lowbias32(x)`` on uint32: ``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15;
  x *= 0x846ca68b; x ^= x >> 16`` (wrapping multiplies).
* ``stream_key(seed, step, bucket, rank)`` folds the four integers with ``lowbias32``
  (see :func:`stream_key`); ``rank=SHARED`` gives a stream every rank agrees on.
* ``uniform``: ``u = ((h >> 8) + 0.5) * 2**-24`` evaluated in fp32 one rounded op at a time,
  exactly as the torch code does it: ``fl(fl(float(h >> 8)) + 0.5) * 2**-24`` (the int -> fp32
  conversion and the multiply are exact; the ``+ 0.5`` rounds to nearest even once
  ``h >> 8 >= 2**23``). So u is in (0, 1]: never 0, mean exactly 1/2, and ``u == 1.0`` for the
  one 24-bit value ``h >> 8 == 2**24 - 1`` (probability 2**-24 per element).
* Element indices ``i`` are the element's position in the flat bucket, as uint32.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

__all__ = [
    "SHARED",
    "lowbias32_int",
    "stream_key",
    "hash_u32",
    "hash_block_",
    "uniform",
    "uniform_into",
    "add_uniform_",
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


def _c(v: int) -> torch.Tensor:
    """0-dim int32 CPU tensor: cheaper to dispatch than a Python scalar, usable on any device."""
    return torch.tensor(_as_i32(v), dtype=torch.int32)


_K16, _K15, _K8 = _c(16), _c(15), _c(8)
_LO16, _LO17, _LO24 = _c(0xFFFF), _c(0x1FFFF), _c(0xFFFFFF)
_C1_T, _C2_T = _c(_C1), _c(_C2)
_HALF_T = torch.tensor(0.5, dtype=torch.float32)


_HI8 = _c(0xFF00)
_NOT_LO8 = _c(0xFFFFFF00)
_B80 = _c(0x80)


def _mix_inplace(h: torch.Tensor, tmp: torch.Tensor, first: bool = True,
                 last: bool = True) -> torch.Tensor:
    """lowbias32 in place on an int32 tensor (logical shifts via mask after arithmetic shift).

    ``first=False`` skips the first xorshift (done by the caller), ``last=False`` the last.
    """
    if first:
        torch.bitwise_right_shift(h, _K16, out=tmp)
        tmp.bitwise_and_(_LO16)
        h.bitwise_xor_(tmp)
    h.mul_(_C1_T)
    torch.bitwise_right_shift(h, _K15, out=tmp)
    tmp.bitwise_and_(_LO17)
    h.bitwise_xor_(tmp)
    h.mul_(_C2_T)
    if last:
        torch.bitwise_right_shift(h, _K16, out=tmp)
        tmp.bitwise_and_(_LO16)
        h.bitwise_xor_(tmp)
    return h


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_SPAN = 1 << 16  # the first xorshift folds into the key over 2**16-aligned spans


def _fold_key(k: int) -> int:
    k &= _M32
    return k ^ (k >> 16)


#: CPU tensors hash with numpy uint32 ops (logical shifts: 9 passes instead of torch int32's
#: 11, and cheaper calls); same bits. Tests flip it to exercise the torch path used elsewhere.
USE_NUMPY_ON_CPU = True

_U = np.uint32


def _np_hash_(h: torch.Tensor, tmp: torch.Tensor, start: int, key: int,
              iota: torch.Tensor | None, last: bool) -> None:
    """CPU twin of the torch ops in :func:`_hash_start_`: shifts and xors in numpy on uint32
    views of the same memory (logical shifts, no masks), the two multiplies with torch's
    in-place int32 ``mul_`` (wrapping; faster than numpy's here)."""
    hn, tn = _u32(h), _u32(tmp)
    io = None if iota is None else _u32(iota)
    n = hn.shape[0]
    P = _pow2_at_least(n)
    if io is not None and P <= _SPAN and io.shape[0] >= n and start % P == 0:
        np.bitwise_xor(io[:n], _U(_fold_key(start ^ key)), out=hn)
    elif io is not None and io.shape[0] >= _SPAN and start % _SPAN == 0:
        m, rem = divmod(n, _SPAN)
        keys = np.array([_fold_key((start + i * _SPAN) ^ key) for i in range(m)], dtype=_U)
        np.bitwise_xor(io[None, :_SPAN], keys[:, None], out=hn[:m * _SPAN].reshape(m, _SPAN))
        if rem:
            np.bitwise_xor(io[:rem], _U(_fold_key((start + m * _SPAN) ^ key)),
                           out=hn[m * _SPAN:])
    else:
        hn[:] = np.arange(start, start + n, dtype=np.int64).astype(_U)
        np.bitwise_xor(hn, _U(key & _M32), out=hn)
        np.right_shift(hn, _U(16), out=tn)
        np.bitwise_xor(hn, tn, out=hn)
    h.mul_(_C1_T)
    np.right_shift(hn, _U(15), out=tn)
    np.bitwise_xor(hn, tn, out=hn)
    h.mul_(_C2_T)
    if last:
        np.right_shift(hn, _U(16), out=tn)
        np.bitwise_xor(hn, tn, out=hn)


def _np_ok(*ts: torch.Tensor) -> bool:
    return USE_NUMPY_ON_CPU and all(t.device.type == "cpu" and t.is_contiguous() for t in ts)


def _u32(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().view(_U)


def _hash_start_(h: torch.Tensor, start: int, key: int, tmp: torch.Tensor,
                 iota: torch.Tensor | None, last: bool) -> torch.Tensor:
    n = h.numel()
    if _np_ok(h, tmp):
        _np_hash_(h, tmp[:n], start, key, iota, last)
        return h
    P = _pow2_at_least(n)
    if iota is not None and P <= _SPAN and iota.numel() >= n and start % P == 0:
        # (start + j) ^ key == j ^ (start ^ key): start is a multiple of the power of two
        # P > j; and the block lies in one 2**16-aligned span, so x >> 16 is the constant
        # k >> 16 and the first xorshift folds into the key as well
        torch.bitwise_xor(iota[:n], _c(_fold_key(start ^ key)), out=h)
        return _mix_inplace(h, tmp, first=False, last=last)
    if iota is not None and iota.numel() >= _SPAN and start % _SPAN == 0:
        # whole 2**16 spans: the same with one folded key per span (a broadcast xor)
        m, rem = divmod(n, _SPAN)
        keys = torch.tensor([_as_i32(_fold_key((start + i * _SPAN) ^ key)) for i in range(m)],
                            dtype=torch.int32).to(h.device, non_blocking=True)
        torch.bitwise_xor(iota[:_SPAN].unsqueeze(0), keys.unsqueeze(1),
                          out=h[:m * _SPAN].view(m, _SPAN))
        if rem:
            torch.bitwise_xor(iota[:rem], _c(_fold_key((start + m * _SPAN) ^ key)),
                              out=h[m * _SPAN:])
        return _mix_inplace(h, tmp, first=False, last=last)
    if iota is not None and iota.numel() >= n and start % P == 0:
        torch.bitwise_xor(iota[:n], _c(start ^ key), out=h)
    else:
        torch.arange(start, start + n, dtype=torch.int32, device=h.device, out=h)
        h.bitwise_xor_(_c(key))
    return _mix_inplace(h, tmp, last=last)


def hash_block_(h: torch.Tensor, start: int, key: int, tmp: torch.Tensor,
                iota: torch.Tensor | None = None) -> torch.Tensor:
    """Fill int32 ``h`` with ``lowbias32(i ^ key)`` for ``i`` in ``[start, start + h.numel())``.

    ``tmp`` is int32 scratch of the same size. ``iota`` (optional) is ``arange(>= n)`` int32:
    when ``start`` is a multiple of the power of two ``P >= n``, ``(start + j) ^ key`` equals
    ``j ^ (start ^ key)`` (no common bits), so one xor replaces arange + xor; within a
    2**16-aligned span the first xorshift folds into that xor too (``iota`` needs
    ``min(n, 2**16)`` elements for that).
    """
    return _hash_start_(h, start, key, tmp, iota, last=True)


def hash_u32(start: int, n: int, key: int, device=None, out: torch.Tensor | None = None,
             tmp: torch.Tensor | None = None) -> torch.Tensor:
    """``lowbias32(i ^ key)`` for ``i`` in ``[start, start + n)`` as int32 bit patterns."""
    if out is None:
        out = torch.empty(n, dtype=torch.int32, device=device)
    if tmp is None:
        tmp = torch.empty_like(out)
    return hash_block_(out, start, key, tmp)


_SCALE = 2.0 ** -24


def uniform_into(out: torch.Tensor, start: int, key: int, ibuf: torch.Tensor | None = None,
                 tmp: torch.Tensor | None = None) -> torch.Tensor:
    """Fill fp32 ``out`` with u in (0, 1] for indices ``[start, start + out.numel())``."""
    n = out.numel()
    h = hash_u32(start, n, key, device=out.device, out=ibuf, tmp=tmp)
    torch.bitwise_right_shift(h, _K8, out=h)
    h.bitwise_and_(_LO24)
    out.copy_(h)  # exact: < 2**24
    out.add_(0.5).mul_(_SCALE)
    return out


def add_uniform_(t: torch.Tensor, start: int, key: int, h: torch.Tensor, tmp: torch.Tensor,
                 v: torch.Tensor, iota: torch.Tensor | None = None) -> torch.Tensor:
    """``t += u`` in place (fp32 ``t``), u as :func:`uniform_into` makes it; same bits as
    ``t.add_(uniform(n, key, start=start))``.

    ``h``/``tmp`` (int32) and ``v`` (fp32; may share ``tmp``'s memory) are scratch of ``t``'s
    size; ``iota`` as in :func:`hash_block_`. On CPU the numpy uint32 views give logical
    shifts, so ``h24`` comes out directly. The torch ops (other devices) avoid the masks a
    logical shift needs on int32 with one pass fewer than the spec's literal order:

    * with ``y`` the hash before its last xorshift, ``h24 = (y ^ (y >>> 16)) >>> 8``; the word
      ``(h24 << 8) | 0x80`` is built from ``y`` with ``(y >> 16) & 0xFF00`` (only bits 8..15
      of the xorshift survive the ``>> 8``), then the low byte is forced to 0x80;
    * as uint32 -> fp32 (round to nearest even), ``h24 * 256 + 128`` becomes exactly
      ``256 * fl(h24 + 0.5)``: the same rounding at 256x the scale (checked for all 2**24
      values in the unit tests);
    * ``t.add_(v, alpha=2**-32)`` then adds ``u`` once rounded (the product is exact, so an
      FMA and a separate multiply agree).
    """
    _hash_start_(h, start, key, tmp, iota, last=False)
    if _np_ok(h, tmp):  # logical shifts: h24 directly, then fl(h24 + 0.5) as the spec says
        hn, tn = _u32(h), _u32(tmp[:h.numel()])
        np.right_shift(hn, _U(16), out=tn)
        np.bitwise_xor(hn, tn, out=hn)
        np.right_shift(hn, _U(8), out=hn)
        v.copy_(h)  # exact: < 2**24
        v.add_(_HALF_T)
        return t.add_(v, alpha=_SCALE)
    torch.bitwise_right_shift(h, _K16, out=tmp)
    tmp.bitwise_and_(_HI8)
    h.bitwise_xor_(tmp)
    h.bitwise_and_(_NOT_LO8).bitwise_or_(_B80)
    v.copy_(h.view(torch.uint32))
    return t.add_(v, alpha=2.0 ** -32)


def uniform(n: int, key: int, device=None, start: int = 0) -> torch.Tensor:
    """A fresh fp32 tensor of ``n`` uniforms in (0, 1) from the stream ``key``."""
    out = torch.empty(n, dtype=torch.float32, device=device)
    return uniform_into(out, start, key)
