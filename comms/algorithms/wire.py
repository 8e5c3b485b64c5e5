"""Flatten a payload (list of tensors of any dtypes) into one uint8 buffer and back."""

from __future__ import annotations

import logging
from typing import Sequence

import torch

__all__ = ["PayloadLayout", "to_bytes", "from_bytes"]

logger = logging.getLogger(__name__)

PayloadLayout = tuple  # ((numel, dtype), ...)


def layout_of(payload: Sequence[torch.Tensor]) -> PayloadLayout:
    return tuple((t.numel(), t.dtype) for t in payload)


def nbytes_of(layout: PayloadLayout) -> int:
    return sum(n * dt.itemsize for n, dt in layout)


def to_bytes(payload: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the raw bytes of every payload tensor (one copy)."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in payload]
    if out is None:
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts, out=out)


def from_bytes(buf: torch.Tensor, layout: PayloadLayout) -> list[torch.Tensor]:
    """Views of ``buf`` as the tensors of ``layout`` (no copy; offsets stay aligned because
    each part is viewed from a fresh slice start)."""
    out, off = [], 0
    for n, dt in layout:
        nb = n * dt.itemsize
        part = buf[off: off + nb]
        # view() needs the storage offset aligned to the element size; copy if it is not
        if dt.itemsize > 1 and part.storage_offset() % dt.itemsize:
            part = part.clone()
        out.append(part.view(dt))
        off += nb
    return out
