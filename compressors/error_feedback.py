"""``ErrorFeedback``: per-bucket residual memory, ``r <- (g + r) - D(C(g + r))``."""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from .base import Compressor, Context

__all__ = ["ErrorFeedback"]

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """Residual memory for any compressor, keyed by bucket index and layout.

    A residual is reused only while the bucket keeps its layout ``(numel, dtype)``; when DDP
    rebuilds its buckets the old residual is dropped (logged at debug) and a fresh zero one is
    used. Residuals are per rank and in the units the hook compresses (already divided by the
    world size).
    """

    __slots__ = ("residuals",)

    def __init__(self):
        self.residuals: dict[int, torch.Tensor] = {}

    def residual(self, bucket: int, like: torch.Tensor) -> torch.Tensor | None:
        r = self.residuals.get(bucket)
        if r is None:
            return None
        if r.numel() != like.numel() or r.dtype != like.dtype or r.device != like.device:
            logger.debug("bucket %d changed layout (%d %s -> %d %s); residual reset",
                         bucket, r.numel(), r.dtype, like.numel(), like.dtype)
            del self.residuals[bucket]
            return None
        return r

    def add_residual_(self, bucket: int, x: torch.Tensor) -> torch.Tensor:
        """``x += residual`` in place (no-op when there is none yet); returns x."""
        r = self.residual(bucket, x)
        if r is not None:
            x.add_(r)
        return x

    def update_(self, bucket: int, x: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        """Store ``x - decoded`` as the bucket's residual, reusing its buffer."""
        r = self.residual(bucket, x)
        if r is None:
            r = torch.empty_like(x)
            self.residuals[bucket] = r
        torch.sub(x, decoded.to(x.dtype), out=r)
        return r

    def reset(self, bucket: int | None = None) -> None:
        if bucket is None:
            self.residuals.clear()
        else:
            self.residuals.pop(bucket, None)

    def compress(self, compressor: Compressor, x: torch.Tensor, ctx: Context
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One local EF round: returns (payload, own decoded); updates the residual.

        ``x`` is not modified.
        """
        r = self.residual(ctx.bucket, x)
        x = x.clone() if r is None else torch.add(x, r)  # one pass, same bits as clone + add_
        payload = compressor.compress(x, ctx)
        decoded = compressor.decompress(payload, ctx)
        self.update_(ctx.bucket, x, decoded)
        return payload, decoded

    def state_dict(self) -> dict:
        return {"residuals": {int(k): v.detach().cpu().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, sd: dict, device=None) -> None:
        self.residuals = {int(k): v.to(device) if device is not None else v.clone()
                          for k, v in sd.get("residuals", {}).items()}
