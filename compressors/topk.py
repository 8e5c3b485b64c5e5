"""``TopK``: keep the k largest-magnitude elements (values + int32 indices on the wire)."""

from __future__ import annotations

import logging
import math

import torch

from .base import Compressor, check_density, check_input
from .hashrng import stream_key, lowbias32_int
from .registry import register

__all__ = ["TopK"]

logger = logging.getLogger(__name__)


@register("topk")
class TopK(Compressor):
    """Top-k sparsification by magnitude.

    Args:
        density: fraction of elements kept, in (0, 1]; ``k = ceil(density * numel)``.
        exact: ``True`` uses ``torch.topk``; ``False`` estimates the k-th magnitude from a
            strided sample (DGC style), keeps the candidates above it, and trims them to at
            most k with a small top-k. The payload always has exactly k slots (unused slots
            are index 0, value 0 and decode to nothing), so sizes match on every rank.
        sample: sample size for ``exact=False`` as a fraction of numel.

    Payload: ``[values (k, input dtype), indices (k, int32)]``. Biased: use error feedback.
    """

    name = "topk"
    families = ("allgather", "two_phase")

    def __init__(self, density: float = 0.01, exact: bool = True, sample: float = 0.01):
        self.density = check_density(density)
        if not isinstance(exact, bool):
            raise TypeError(f"exact must be a bool, got {exact!r}")
        self.exact = exact
        self.sample = check_density(sample)

    def config(self):
        cfg = {"density": self.density, "exact": self.exact}
        if not self.exact:
            cfg["sample"] = self.sample
        return cfg

    def k_for(self, numel: int) -> int:
        return max(1, min(numel, math.ceil(self.density * numel))) if numel else 0

    def wire_bytes(self, numel, dtype=torch.float32):
        return self.k_for(numel) * (dtype.itemsize + 4)

    def compress(self, x, ctx):
        check_input(x)
        n = x.numel()
        k = self.k_for(n)
        if k == 0:
            return [x.new_empty(0), torch.empty(0, dtype=torch.int32, device=x.device)]
        a = x.abs()
        if self.exact or k * 8 >= n:
            idx = torch.topk(a, k, sorted=False).indices
        else:
            idx = self._approx_indices(a, k, ctx)
        vals = x[idx]
        if idx.numel() < k:  # rare: the sampled threshold was too high; pad with no-ops
            pad = k - idx.numel()
            idx = torch.cat([idx, idx.new_zeros(pad)])
            vals = torch.cat([vals, vals.new_zeros(pad)])
        return [vals, idx.to(torch.int32)]

    def _approx_indices(self, a: torch.Tensor, k: int, ctx) -> torch.Tensor:
        n = a.numel()
        s = max(min(n, 2048), math.ceil(self.sample * n))
        stride = max(1, n // s)
        offset = lowbias32_int(stream_key(ctx.seed, ctx.step, ctx.bucket, ctx.rank)) % stride
        sample = a[offset::stride]
        # aim 10% above k so the trim below usually has enough candidates
        ks = min(sample.numel(), max(1, math.ceil(1.1 * k * sample.numel() / n)))
        thr = torch.topk(sample, ks, sorted=False).values.min()
        cand = torch.nonzero(a >= thr).squeeze(1)
        if cand.numel() > k:
            cand = cand[torch.topk(a[cand], k, sorted=False).indices]
        return cand

    def decompress(self, payload, ctx):
        out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=payload[0].device)
        return self.decompress_add_(payload, ctx, out)

    def decompress_add_(self, payload, ctx, acc):
        vals, idx = payload
        return acc.index_add_(0, idx.long(), vals.to(acc.dtype))

    def error_bound(self, x):
        # dropped elements are below the k-th magnitude; kept ones are exact
        return x.abs()
