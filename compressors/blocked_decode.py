"""The blocked decode loop of the scaled-codes codecs' torch path (QSGD, ScaledSign).

A whole-bucket decode would fill a bucket-sized fp32 temporary; decoding block by block into
a reused scratch buffer keeps the work in cache and page-faults nothing. The loop owns the
one subtle part, the rounding: a codec decodes fp32 values, ``decompress`` returns them in
``ctx.dtype``, so a block is rounded to ``ctx.dtype`` before it is written or added — the bits
of ``out.copy_(decompress(...))`` / ``out.add_(decompress(...))``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .context import Context
from .memory import Workspace

__all__ = ["decode_blocks"]


def decode_blocks(ws: Workspace, block: int, ctx: Context, out: torch.Tensor, accumulate: bool,
                  device, decode_block: Callable[[int, int, torch.Tensor], object]) -> torch.Tensor:
    """Run ``decode_block(b0, b1, f)`` (fills fp32 ``f`` with elements ``[b0, b1)``) over
    blocks of ``block`` elements, writing ``out[b0:b1] = f`` or adding it, with the bits of
    ``out.copy_(decompress(...))`` / ``out.add_(decompress(...))``: values are rounded to
    ``ctx.dtype`` first, as ``decompress`` returns them. ``out`` is flat and contiguous;
    ``ws`` holds the scratch (``"dec.f"``, ``"dec.g"``). Returns ``out``."""
    n = ctx.numel
    if out.numel() != n:
        raise ValueError(f"output has {out.numel()} elements, context says {n}")
    cap = min(block, n)
    # fp32 all the way: decode straight into the output, no scratch and no copy
    direct = not accumulate and out.dtype == torch.float32 and ctx.dtype == torch.float32
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        L = b1 - b0
        f = out[b0:b1] if direct else ws.get("dec.f", cap, torch.float32, device)[:L]
        decode_block(b0, b1, f)
        if direct:
            continue
        if ctx.dtype != torch.float32:
            f = ws.get("dec.g", cap, ctx.dtype, device)[:L].copy_(f)
        if accumulate:
            out[b0:b1].add_(f)
        else:
            out[b0:b1].copy_(f)
    return out
