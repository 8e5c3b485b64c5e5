"""The cheap cross-rank layout check that multi-round algorithms run before moving data.

A rank whose bucket has a different numel or dtype than the others would make the next
collective mismatch (undefined behaviour or a hang). One all_gather of two int64 per rank
lets every rank see every layout and raise the same ``ValueError`` — before any payload moves.
"""

from __future__ import annotations

import logging

import torch

from ..transport.errors import advice, where
from .base import round_wait

__all__ = ["DTYPE_CODES", "HEADER_BYTES", "check_same_layout"]

logger = logging.getLogger(__name__)

DTYPE_CODES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
HEADER_BYTES = 16  # (numel, dtype code) as int64


def check_same_layout(comm, name: str, ctx) -> None:
    """All-gather ``(numel, dtype)`` and raise on every rank if any rank differs.

    Blocks the caller for one small collective (a host sync: the sizes decide what follows).

    Raises:
        ValueError: bucket numel or dtype differs across ranks (raised on every rank).
        TypeError: the dtype is not a float type the algorithms move.
    """
    if ctx.dtype not in DTYPE_CODES:
        raise TypeError(f"{name}: unsupported bucket dtype {ctx.dtype}; expected one of {DTYPE_CODES}")
    header = torch.tensor([ctx.numel, DTYPE_CODES.index(ctx.dtype)], dtype=torch.int64)
    if ctx.device.type != "cpu" and comm.backend not in ("gloo", "mpi"):
        header = header.to(ctx.device)
    what = where(comm, f"{name} layout-check allgather", ctx.bucket, ctx.numel, ctx.dtype, ctx.step)
    table = round_wait(comm, comm.all_gather(header), ctx, f"{name} layout-check allgather").view(comm.world_size, 2).cpu().tolist()
    if table[comm.rank] != header.tolist() or any(not 0 <= d < len(DTYPE_CODES) or n < 0 for n, d in table):
        # gloo can hand back garbage instead of an error once a peer died: not a user error
        raise RuntimeError(f"{what} returned a corrupt table (this rank's own row or a dtype code "
                           f"is wrong): a peer died or disconnected; {advice()}")
    if any(row != table[0] for row in table):
        desc = [(n, str(DTYPE_CODES[d]) if 0 <= d < len(DTYPE_CODES) else d) for n, d in table]
        raise ValueError(f"commpress: {name}: bucket {ctx.bucket} layout (numel, dtype) differs across ranks: "
                         f"{desc}; every rank must pass the same bucket sizes and dtypes")
