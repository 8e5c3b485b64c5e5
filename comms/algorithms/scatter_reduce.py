"""``scatter_reduce``: the scatter-reduce half of ``two_phase`` — a compressed reduce-scatter.

FSDP's reduce-scatter of a module's flat padded gradient: each rank compresses the chunk of
``x`` each destination owns (:func:`~comms.algorithms.two_phase.scatter_send`), one
``all_to_all`` moves them, and the owner decodes and sums them **in rank order** into its
chunk (:func:`~comms.algorithms.two_phase.decode_sum`). No second compression: the owner's
sum is what the caller keeps, so every rank holds the bits it owns and nobody recomputes
them (ARCHITECTURE.md §5, "computed once"). The sum is this rank's chunk only (``shard``).

``want.exact_own``: this rank's own chunk stays home, never encoded, and is added exactly (its
``own`` slice is ``x`` itself: no error to feed back) — the codec does ``(W - 1) / W`` of the
work. ``want.tail``: bytes riding every payload (FSDP's non-finite flag), back as
``sum.tails`` (one row per rank). The sum comes back as a :class:`ShardSum` decoded only where
it is written, so the exchange may overlap the rest of backward and the decode happen when
the caller lands it. Bytes per rank: ``(W - 1) * (P + len(tail))``, ``P`` one chunk's payload.
"""

from __future__ import annotations

import torch

from compressors.deferred import Deferred

from .base import PLAIN, Algorithm, Want, hand_over
from .two_phase import decode_sum, scatter_send

__all__ = ["ScatterReduce", "ShardSum", "scatter_reduce"]


class ShardSum(Deferred):
    """This rank's chunk of the sum, decoded from every rank's payload in rank order when it is
    materialized (``tails``: each rank's tail bytes, ``(world, len(tail))`` uint8, or None)."""

    __slots__ = ("compressor", "recv", "layout", "nb", "stride", "ctx", "world", "rank", "exact", "tails")

    def __init__(self, compressor, recv, layout, nb, stride, ctx, world, rank, exact, tail_len):
        self.compressor, self.recv, self.layout, self.nb, self.stride = compressor, recv, layout, nb, stride
        self.ctx, self.world, self.rank, self.exact = ctx, world, rank, exact
        self.tails = recv.view(world, stride)[:, nb:nb + tail_len] if tail_len else None

    def materialize(self) -> torch.Tensor:
        return decode_sum(self.compressor, self.recv, self.layout, self.nb, self.stride, self.ctx,
                          self.world, self.rank, exact=self.exact)


class ScatterReduce(Algorithm):
    """Compressed reduce-scatter (see the module docstring)."""

    name = "scatter_reduce"
    family = "scatter_reduce"
    shard = True

    def supports(self, compressor) -> bool:
        # every receiver decodes any rank's chunk payload, and chunk payloads have one size
        return compressor.fixed_size and (compressor.supports("two_phase") or compressor.supports("allgather"))

    def __call__(self, comm, compressor, x, ctx, store, want: Want = PLAIN):
        world, rank, n = comm.world_size, comm.rank, x.numel()
        m = n // world
        fut, own, layout, nb, stride = scatter_send(comm, compressor, x, ctx, tail=want.tail,
                                                    exact_own=want.exact_own)
        exact = own[rank * m:(rank + 1) * m] if want.exact_own else None
        tail_len = 0 if want.tail is None else want.tail.numel()
        mine = hand_over(own[:n], want.on_own)  # e.g. the residual, while the payloads travel
        return fut.then(lambda f: (ShardSum(compressor, f.value(), layout, nb, stride, ctx, world, rank,
                                            exact, tail_len), mine))

    def wire_bytes(self, compressor, numel, dtype=torch.float32, world=2):
        return (world - 1) * compressor.wire_bytes(numel // world, dtype)


scatter_reduce = ScatterReduce()
