"""``Identity``: no compression (the dense baseline through the same code path)."""

from __future__ import annotations

import logging

from .base import Compressor
from .context import check_input
from .registry import register

__all__ = ["Identity"]

logger = logging.getLogger(__name__)


@register("identity", "none")
class Identity(Compressor):
    """Sends the input as it is; lossless, linear."""

    name = "identity"
    families = ("allreduce", "allgather", "two_phase")
    lossless = True
    unbiased = True

    def compress(self, x, ctx):
        check_input(x)
        return [x]

    def decompress(self, payload, ctx):
        return payload[0].to(ctx.dtype)

    def decompress_into(self, payload, ctx, out):
        p = payload[0]
        if out.dtype == ctx.dtype or p.dtype == ctx.dtype:
            return out.copy_(p.reshape(out.shape))
        return super().decompress_into(payload, ctx, out)

    def wire_bytes(self, numel, dtype=None):
        import torch
        return numel * (dtype or torch.float32).itemsize

    def error_bound(self, x):
        return x.new_zeros(x.shape)
