"""The chunk layout of the scatter-reduce algorithms (``two_phase`` and FSDP's
``scatter_reduce``, which shares its first half): a bucket of ``n`` elements cut into one
chunk of ``m = ceil(n / W)`` elements per owner rank, the last one zero-padded.

Per chunk: its slice of the bucket (:func:`chunk_of`), its context — the hash-RNG stream it is
compressed with and the tensor pieces it holds (:func:`chunk_context`, :func:`chunk_shapes`) —
and the layout its payload takes on the wire (:class:`ChunkWire`). Everything here is derived
from sizes and shapes that every rank shares, so every rank cuts, pads and reads alike.
"""

from __future__ import annotations

import functools
import math

import torch

from .wire import from_bytes, layout_of, nbytes_of, to_bytes

__all__ = ["chunk_of", "chunk_shapes", "chunk_context", "ChunkWire"]


def chunk_of(x: torch.Tensor, j: int, m: int) -> torch.Tensor:
    """Chunk ``j`` of flat ``x`` in chunks of ``m`` elements: a view, or a zero-padded copy
    where the chunk runs past the end of ``x``."""
    lo, hi = j * m, min(x.numel(), (j + 1) * m)
    if hi - lo == m:
        return x[lo:hi]
    out = x.new_zeros(m)
    if hi > lo:
        out[: hi - lo] = x[lo:hi]
    return out



def chunk_shapes(ctx, world: int, j: int) -> tuple:
    """The pieces of the bucket's tensors that chunk ``j`` holds, as 1-D shapes (the zero
    padding of a short last chunk is a piece of its own), so that a tensor-aligned compressor
    (``align="tensor"``) restarts its scales at every tensor inside the chunk too; ``()`` when
    the context knows no shapes or the chunk lies inside one tensor (the flat layout)."""
    shapes = ctx.known_shapes()
    return _pieces(shapes, ctx.numel, world, j) if len(shapes) >= 2 else ()


@functools.lru_cache(maxsize=1024)  # the same few (bucket, world, chunk) every step
def _pieces(shapes: tuple, numel: int, world: int, j: int) -> tuple:
    m = -(-numel // world)
    lo, hi = j * m, (j + 1) * m
    pieces, e = [], 0
    for sh in shapes:
        n = math.prod(sh)
        a, b = max(lo, e), min(hi, e + n)
        if b > a:
            pieces.append((b - a,))
        e += n
    if hi > numel:
        pieces.append((hi - max(lo, numel),))
    return tuple(pieces) if len(pieces) > 1 else ()


def chunk_context(ctx, world: int, phase: int, j: int, rank: int):
    """The context of chunk ``j`` in ``phase`` (1: scatter, 2: owner re-compression): its
    own stream key and the tensor pieces it holds (:func:`chunk_shapes`)."""
    m = -(-ctx.numel // world)
    return ctx.with_(numel=m, bucket=((ctx.bucket * 2 + phase - 1) * world + j) & 0xFFFFFFFF, rank=rank,
                     shapes=chunk_shapes(ctx, world, j))


class ChunkWire:
    """The payload layout every chunk takes on the wire and each chunk's own layout.

    Chunks that hold different tensor pieces can have payloads of different sizes (a
    tensor-aligned codec has a scale more per piece); on the wire every payload tensor is
    zero-padded to its largest size over the chunks, so all chunk payloads have the same byte
    size (an ``all_to_all`` / ``all_gather`` of equal blocks), and cut back to the chunk's own
    layout before decoding. Every rank derives the same layouts from the same shapes.
    """

    __slots__ = ("wire", "chunks", "nbytes")

    def __init__(self, chunks: list):
        first = chunks[0]
        if any(len(c) != len(first) or any(dt != d0 for (_, dt), (_, d0) in zip(c, first)) for c in chunks):
            raise RuntimeError("two_phase: chunk payloads differ in their tensors' count or dtypes")
        self.chunks = tuple(chunks)
        self.wire = tuple((max(c[k][0] for c in chunks), first[k][1]) for k in range(len(first)))
        self.nbytes = nbytes_of(self.wire)

    def write(self, payload, out: torch.Tensor) -> None:
        """``payload``'s bytes into ``out`` (``nbytes``), each tensor zero-padded to the wire."""
        if layout_of(payload) == self.wire:
            to_bytes(payload, out=out)
            return
        off = 0
        for t, (n, dt) in zip(payload, self.wire):
            nb = n * dt.itemsize
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            out[off: off + raw.numel()].copy_(raw)
            out[off + raw.numel(): off + nb].zero_()
            off += nb

    def read(self, buf: torch.Tensor, j: int) -> list:
        """Chunk ``j``'s payload from its wire bytes (views, cut to the chunk's own layout)."""
        parts = from_bytes(buf, self.wire)
        return [p[:n] for p, (n, _) in zip(parts, self.chunks[j])]
