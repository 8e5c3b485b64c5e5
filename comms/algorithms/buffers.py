"""Bucket-sized buffers of the algorithms' hot paths, reused instead of allocated per step.

A fresh 100 MB tensor costs its page faults on first touch: ``torch.zeros(25_000_000)``
measured 416-486 ms against 55-62 ms for ``zero_()`` of a reused one on this (then heavily
loaded) 2-core machine — the decoded sums, this rank's decoded contribution and the send
buffers of every step paid that. :data:`POOL` is a :class:`compressors.base.PayloadPool`: a
buffer is handed out again only when nothing references it any more (torch's storage use
count counts every tensor, view and collective work holding it), so a result still read by
the hook, DDP or a pending collective is never overwritten; to the caller a buffer is
indistinguishable from a fresh one (contents undefined: zero it where a sum starts).
"""

from __future__ import annotations

import torch

from compressors.memory import PayloadPool

__all__ = ["POOL", "empty", "zeros"]

# several buckets and steps may hold buffers of one size at once (DDP overlaps buckets; a
# result lives until its future is dropped): more than the compressors' payload default
POOL = PayloadPool(per_key=8)


def empty(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``n`` elements from :data:`POOL` (fresh below 2 MB)."""
    return POOL.empty(n, dtype, device)


def zeros(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.zeros(n)`` from :data:`POOL` (one write pass instead of fresh pages)."""
    return POOL.empty(n, dtype, device).zero_()
