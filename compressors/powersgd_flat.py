"""PowerSGD's flat form: a bucket whose tensor shapes are unknown (a hierarchical shard, a
direct call) factorized as one zero-padded, close-to-square matrix.

``cols = ceil(sqrt(n))``, ``rows = ceil(n / cols)`` (:func:`~compressors.powersgd_layers.matrix_shape`):
close to square is what makes the factors small. The per-layer form
(:mod:`compressors.powersgd_layers`) replaces it whenever the bucket's shapes are known.
"""

from __future__ import annotations

import torch

from .powersgd_layers import matrix_shape
from .reproducible import outer_sum_into

__all__ = ["flat_plan", "padded_matrix", "flat_decode"]


def flat_plan(numel: int, rank: int, min_compression_rate: float) -> tuple[int, int, int] | None:
    """``(rows, cols, r)`` of a bucket of ``numel`` elements, or ``None`` when its factors
    would not be ``min_compression_rate`` times smaller (the bucket goes dense)."""
    rows, cols = matrix_shape(numel)
    r = min(rank, rows, cols)
    if numel < 2 or numel < min_compression_rate * r * (rows + cols):
        return None
    return rows, cols, r


def padded_matrix(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Flat ``x`` as an fp32 ``rows x cols`` matrix: a view when it fills it exactly in fp32,
    else a zero-padded copy."""
    n = x.numel()
    if n == rows * cols and x.dtype == torch.float32:
        return x.reshape(rows, cols)
    m = torch.zeros(rows * cols, dtype=torch.float32, device=x.device)
    m[:n] = x
    return m.view(rows, cols)


def flat_decode(p: torch.Tensor, q: torch.Tensor, ctx, scratch: torch.Tensor) -> torch.Tensor:
    """``P Q^T`` of the flat matrix in a fixed summation order (rank-reproducible: runs after
    the sums), cut to ``ctx.numel`` as a fresh tensor of ``ctx.dtype``; ``scratch`` is
    :func:`~compressors.reproducible.outer_sum_into`'s."""
    m = torch.empty(p.shape[0], q.shape[0], dtype=torch.float32, device=p.device)
    outer_sum_into(m, p, q.t(), scratch)
    return m.reshape(-1)[: ctx.numel].to(ctx.dtype)
