"""Shared code of the low-precision casts ``FP16`` and ``BF16`` (one file each)."""

from __future__ import annotations

import logging
from typing import ClassVar

import torch

from .base import Compressor, check_input, fresh_empty

__all__ = ["Cast"]

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

    def wire_bytes(self, numel, dtype=None):
        return numel * self.wire_dtype.itemsize

    def error_bound(self, x):
        # half an ulp of the wire dtype, relative; plus the smallest subnormal for tiny values
        info = torch.finfo(self.wire_dtype)
        return x.abs() * (info.eps / 2) + info.smallest_normal * info.eps
