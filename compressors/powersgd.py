"""``PowerSGD``: rank-r approximation by one power iteration (Vogels et al., 2019), linear family.

The flat bucket of ``n`` elements is viewed as a matrix ``M`` of ``rows x cols`` with
``cols = ceil(sqrt(n))``, ``rows = ceil(n / cols)`` (zero-padded; close to square, which is
what makes the factors small). One step, with ``Q`` (``cols x r``) shared by every rank:

1. ``P = M Q``; allreduce ``P`` (sum); orthogonalize its columns (Gram-Schmidt) — every rank
   holds the same summed bits, so the orthogonalization is identical everywhere;
2. ``Q = M^T P``; allreduce ``Q``; the aggregate is ``P Q^T``.

``own = P (M^T P)^T`` (this rank's part of the aggregate) feeds the caller's error feedback;
``Q`` is kept (warm start) in the per-bucket ``store`` as ``store["powersgd_q"]`` together
with ``store["powersgd_p"]``, so both checkpoint with the hook state and a changed bucket
layout re-initializes them. A bucket whose factors would not be at least
``min_compression_rate`` times smaller than the bucket is sent dense.

Both rounds are issued from the caller's thread: the ``P`` round is waited for there and
only the ``Q`` round is asynchronous. torch's ``powerSGD_hook`` issues the second allreduce
from a completion callback, where it races with the next bucket's first allreduce and
mismatches collectives on gloo ("Received data size doesn't match expected size"); this
one works with any number of buckets.

Example::

    >>> state = comms.register(ddp_model, "powersgd:rank=2")
"""

from __future__ import annotations

import logging
import math

import torch

from .base import Compressor, check_input
from .hashrng import SHARED, stream_key, uniform
from .registry import register

__all__ = ["PowerSGD", "matrix_shape", "orthogonalize_"]

logger = logging.getLogger(__name__)


def matrix_shape(numel: int) -> tuple[int, int]:
    """``(rows, cols)`` close to square with ``rows * cols >= numel``."""
    cols = max(1, math.isqrt(max(numel - 1, 0)) + 1) if numel > 1 else 1
    return -(-numel // cols), cols


def orthogonalize_(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p`` in place (deterministic: fixed op order)."""
    for i in range(p.shape[1]):
        col = p[:, i]
        for j in range(i):
            col.sub_(torch.dot(col, p[:, j]) * p[:, j])
        col.div_(torch.linalg.vector_norm(col) + eps)
    return p


@register("powersgd")
class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with warm start (linear family, via ``linear_aggregate``).

    Args:
        rank: rank of the approximation (columns of ``P`` and ``Q``), >= 1.
        warm_start: reuse last step's aggregated ``Q`` (else a fresh shared random ``Q``).
        min_compression_rate: send buckets dense unless ``n >= rate * r * (rows + cols)``.

    Biased: use error feedback (the hook turns it on by default).

    .. warning::
        Every rank must call with the same buckets in the same order (the hook does):
        ``Q`` is shared state that must stay identical on every rank.
    """

    name = "powersgd"
    families = ("allreduce",)

    def __init__(self, rank: int = 1, warm_start: bool = True, min_compression_rate: float = 2.0):
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {rank!r}")
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank!r}")
        if not isinstance(warm_start, bool):
            raise TypeError(f"warm_start must be a bool, got {warm_start!r}")
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)):
            raise TypeError(f"min_compression_rate must be a number, got {min_compression_rate!r}")
        if not min_compression_rate >= 1:
            raise ValueError(f"min_compression_rate must be >= 1, got {min_compression_rate!r}")
        self.rank = rank
        self.warm_start = warm_start
        self.min_compression_rate = float(min_compression_rate)

    def config(self):
        return {"rank": self.rank, "warm_start": self.warm_start,
                "min_compression_rate": self.min_compression_rate}

    # -- shapes and accounting -------------------------------------------------------
    def plan(self, numel: int) -> tuple[int, int, int] | None:
        """``(rows, cols, r)``, or ``None`` when the bucket goes dense."""
        rows, cols = matrix_shape(numel)
        r = min(self.rank, rows, cols)
        if numel < 2 or numel < self.min_compression_rate * r * (rows + cols):
            return None
        return rows, cols, r

    def wire_bytes(self, numel, dtype=torch.float32):
        pl = self.plan(numel)
        if pl is None:
            return numel * dtype.itemsize
        rows, cols, r = pl
        return 4 * r * (rows + cols)  # fp32 P and Q, each allreduced once

    # -- local round trip (no communication): one power iteration on this rank's M -----
    def _matrix(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        n = x.numel()
        if n == rows * cols and x.dtype == torch.float32:
            return x.reshape(rows, cols)
        m = torch.zeros(rows * cols, dtype=torch.float32, device=x.device)
        m[:n] = x
        return m.view(rows, cols)

    def _initial_q(self, ctx, cols: int, r: int) -> torch.Tensor:
        # shared stream: the same Q on every rank; a fresh one per step without warm start
        key = stream_key(ctx.seed, 0 if self.warm_start else ctx.step, ctx.bucket, SHARED)
        return uniform(cols * r, key, device=ctx.device).sub_(0.5).view(cols, r)

    def compress(self, x, ctx):
        check_input(x)
        pl = self.plan(x.numel())
        if pl is None:
            return [x.reshape(-1)]
        rows, cols, r = pl
        m = self._matrix(x, rows, cols)
        p = orthogonalize_(m @ self._initial_q(ctx, cols, r))
        return [p, m.t() @ p]

    def decompress(self, payload, ctx):
        if len(payload) == 1:
            return payload[0].to(ctx.dtype)
        p, q = payload
        return (p @ q.t()).reshape(-1)[: ctx.numel].to(ctx.dtype)

    def error_bound(self, x):
        # a projection: |error_ij| <= ||M - P P^T M||_F <= ||M||_F (dense buckets: exact)
        if self.plan(x.numel()) is None:
            return x.new_zeros(x.shape)
        return torch.linalg.vector_norm(x.float()).expand(x.shape).to(x.dtype)

    # -- the multi-round allreduce (called by the ``allreduce`` algorithm) --------------
    def linear_aggregate(self, comm, x, ctx, store):
        """Two allreduces (``P`` then ``Q``); returns ``Future[(sum, own)]``."""
        check_input(x)
        pl = self.plan(x.numel())
        if pl is None:  # small bucket: dense; own == x, so the residual is zero
            return comm.all_reduce(x.detach().clone()).then(lambda f: (f.value(), x))
        rows, cols, r = pl
        m = self._matrix(x, rows, cols)
        q = store.get("powersgd_q")
        if (not self.warm_start or q is None or tuple(q.shape) != (cols, r)
                or q.dtype != torch.float32 or q.device != x.device):
            q = self._initial_q(ctx, cols, r)
        p = m @ q
        p = comm.all_reduce(p).wait()  # intermediate round: waited here (see module docstring)
        orthogonalize_(p)
        q_local = m.t() @ p
        fut = comm.all_reduce(q_local.clone())
        own = (p @ q_local.t()).reshape(-1)[: ctx.numel].to(ctx.dtype)  # overlaps the Q round

        def done(f):
            q_sum = f.value()
            store["powersgd_p"] = p
            store["powersgd_q"] = q_sum
            return (p @ q_sum.t()).reshape(-1)[: ctx.numel].to(ctx.dtype), own

        return fut.then(done)
