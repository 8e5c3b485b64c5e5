"""Shared code of the low-precision casts ``FP16`` and ``BF16`` (one file each)."""

from __future__ import annotations

import logging
from typing import ClassVar

import torch

from . import cpu_kernels
from .base import Compressor
from .deferred import Deferred, same_flat
from .context import check_input
from .memory import fresh_empty

__all__ = ["Cast", "CastOwn", "CastSum"]

logger = logging.getLogger(__name__)


class Cast(Compressor):
    """Round to a narrower float (round-to-nearest-even); linear: summed in that float."""

    wire_dtype: ClassVar[torch.dtype]
    families = ("allreduce", "allgather", "two_phase")
    unbiased = False  # round-to-nearest: error feedback removes the drift

    def compress(self, x, ctx):
        check_input(x)
        if x.dtype == self.wire_dtype:
            return [x]
        # reused payload memory once nobody holds it (no page faults of a fresh buffer)
        return [self.payload_pool().empty(x.numel(), self.wire_dtype, x.device).view(x.shape).copy_(x)]

    def decompress(self, payload, ctx):
        p = payload[0]
        if p.dtype == ctx.dtype:
            return p
        return fresh_empty(p.numel(), ctx.dtype, p.device).view(p.shape).copy_(p)

    def decompress_into(self, payload, ctx, out):
        p = payload[0]
        if out.dtype == ctx.dtype or p.dtype == ctx.dtype:  # one rounding either way
            return out.copy_(p.reshape(out.shape))
        return super().decompress_into(payload, ctx, out)

    def deferred_own(self, x, payload, ctx):
        """A :class:`CastOwn` for an fp32 bucket (recomputed from ``x``), else None."""
        if x.dtype != torch.float32 or ctx.dtype != torch.float32 or self.wire_dtype not in _WIRE_CODE:
            return None
        return CastOwn(x.reshape(-1), self.wire_dtype)

    def deferred_sum(self, summed, ctx):
        """A :class:`CastSum` of the summed payload for an fp32 bucket, else None."""
        if ctx.dtype != torch.float32 or len(summed) != 1 or summed[0].dtype not in _WIRE_CODE:
            return None
        return CastSum(summed[0].reshape(-1))

    def wire_bytes(self, numel, dtype=None):
        return numel * self.wire_dtype.itemsize

    def error_bound(self, x):
        # half an ulp of the wire dtype, relative; plus the smallest subnormal for tiny values
        info = torch.finfo(self.wire_dtype)
        return x.abs() * (info.eps / 2) + info.smallest_normal * info.eps


_WIRE_CODE = {torch.float16: 1, torch.bfloat16: 2}  # cp_cast_finish's wire dtype codes


def _finish_kernel(own: "CastOwn", x: torch.Tensor, r: torch.Tensor, *more):
    """The compiled library when ``x`` is the fp32 bucket ``own`` was made from and ``r``,
    ``more`` fit it (contiguous CPU tensors), else None: the torch path."""
    if x.dtype != torch.float32 or not same_flat(x, own.x, r) or not all(t.is_contiguous() for t in more):
        return None
    return cpu_kernels.lib(x, r, *more)


class CastOwn(Deferred):
    """This rank's decoded contribution ``widen(narrow(x))`` of an fp32 bucket, computed from
    ``x`` when it is needed: the allreduce sums the payload in place, and rounding ``x`` again
    costs less than keeping a copy of the payload. Valid while ``x`` is unchanged (the hook
    writes ``x`` only after the residual is read). Every method gives the bits of decoding the
    payload (``cp_cast_finish``; tests/unit/test_cast_deferred.py)."""

    __slots__ = ("x", "wire")

    def __init__(self, x: torch.Tensor, wire: torch.dtype):
        self.x, self.wire = x, wire

    def materialize(self) -> torch.Tensor:
        return self.x.to(self.wire).to(self.x.dtype)

    def residual_(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        ck = _finish_kernel(self, x, r)
        if ck is None:
            return super().residual_(x, r)
        ck.cp_cast_finish(x.data_ptr(), r.data_ptr(), None, _WIRE_CODE[self.wire], x.numel(), cpu_kernels.threads())
        return r


class CastSum(Deferred):
    """The allreduce-summed payload of a cast compressor (fp16/bf16), widened to fp32 only
    where the hook writes it: straight into the bucket (:meth:`into_`), or together with this
    rank's residual in one pass (:meth:`into_with_residual_`, ``cp_cast_finish``: ``x`` read
    and written once)."""

    __slots__ = ("summed",)

    def __init__(self, summed: torch.Tensor):
        self.summed = summed

    def materialize(self) -> torch.Tensor:
        return self.summed.to(torch.float32)

    def into_(self, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self.summed.view(out.shape))  # widening is exact: one pass, no temporary

    def into_with_residual_(self, own: Deferred, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``own.residual_(x, r)`` then :meth:`into_` in one compiled pass when ``own`` is the
        :class:`CastOwn` of this ``x``; the same bits either way."""
        ok = (isinstance(own, CastOwn) and own.wire == self.summed.dtype
              and own.x.numel() == self.summed.numel())
        ck = _finish_kernel(own, x, r, self.summed) if ok else None
        if ck is None:
            return super().into_with_residual_(own, x, r)
        ck.cp_cast_finish(x.data_ptr(), r.data_ptr(), self.summed.data_ptr(), _WIRE_CODE[own.wire],
                          x.numel(), cpu_kernels.threads())
        return x
