"""Deferred results: a bucket-sized decode that is written where the caller says, not into a
temporary (the hook writes the residual ``x - own`` and the aggregate straight into their
buffers)."""

from __future__ import annotations

import torch

__all__ = ["Deferred", "SparseOwn", "same_flat", "materialized"]


class Deferred:
    """A bucket-sized decoded result not written anywhere yet.

    Returned (for this rank's own contribution and the aggregate) by an algorithm called with
    ``deferred=True`` (the hook, where the algorithm's ``deferred_results`` says it can): the
    hook writes the residual ``x - own`` and the aggregate straight into their buffers, which
    saves a bucket-sized temporary and a copy per result. Every method gives the bits of the
    materialized tensor."""

    def materialize(self) -> torch.Tensor:
        """The values as a flat tensor of the bucket dtype."""
        raise NotImplementedError

    def into_(self, out: torch.Tensor) -> torch.Tensor:
        """``out.copy_(self.materialize())``; returns ``out``."""
        return out.copy_(self.materialize())

    def residual_(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``torch.sub(x, self.materialize(), out=r)``; returns ``r``."""
        return torch.sub(x, self.materialize().to(x.dtype), out=r)

    def into_with_residual_(self, own: "Deferred", x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``own.residual_(x, r)`` then ``self.into_(x)`` (this is the aggregate, ``own`` this
        rank's part of the same round); a subclass may do both in one pass. Returns ``x``."""
        own.residual_(x, r)
        return self.into_(x)


def same_flat(x: torch.Tensor, ref: torch.Tensor, r: torch.Tensor) -> bool:
    """``x`` is ``ref``'s memory (the tensor a Deferred was made from) and ``x``, ``r`` are
    contiguous tensors of one size and dtype: a fused pass over them may read ``ref`` as ``x``."""
    n = ref.numel()
    return (x.data_ptr() == ref.data_ptr() and x.numel() == n and r.numel() == n and r.dtype == x.dtype
            and x.is_contiguous() and r.is_contiguous())


class SparseOwn(Deferred):
    """A sparsifier's own contribution: ``own[idx] = vals``, zero elsewhere (``vals`` the
    decoded values, bit for bit what the decode writes). Its residual ``x - own`` is ``x`` off
    the indices: :meth:`residual_` copies ``x`` and subtracts at ``idx`` only — no decoded
    bucket-sized temporary and one pass fewer (the same bits, -0, inf and quiet NaN included,
    since ``v - (+0) = v``)."""

    __slots__ = ("x", "idx", "vals")

    def __init__(self, x: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor):
        self.x, self.idx, self.vals = x, idx, vals

    def materialize(self) -> torch.Tensor:
        return torch.zeros(self.x.numel(), dtype=self.x.dtype, device=self.x.device).index_copy_(
            0, self.idx, self.vals)

    def residual_(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if not same_flat(x, self.x, r):
            return super().residual_(x, r)
        xf, rf = x.view(-1), r.view(-1)
        rf.copy_(xf)
        if self.idx.numel():
            rf.index_copy_(0, self.idx, torch.index_select(xf, 0, self.idx) - self.vals)
        return r


def materialized(t):
    """``t`` as a tensor (a :class:`Deferred` is materialized)."""
    return t.materialize() if isinstance(t, Deferred) else t
