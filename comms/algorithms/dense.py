"""The dense routes as algorithms: no compression, the sum as the collective makes it.

``dense_allreduce`` (DDP's plain allreduce; HSDP's plain replicate all-reduce): ``x`` summed in
place, the sum is ``x``. ``dense_reduce_scatter`` (FSDP's plain reduce-scatter): this rank's
chunk of the sum (on gloo an all_to_all and a rank-order sum:
:meth:`comms.transport.communicator.TorchCommunicator.reduce_scatter`). Neither keeps a
residual: ``own`` comes back None (what was sent is ``x`` itself). They are not in
:data:`comms.algorithms.ALGORITHMS`: ``"dense"`` names a route, not a candidate.
"""

from __future__ import annotations

import torch

from .base import DENSE, PLAIN, Algorithm, Want

__all__ = ["DenseAllReduce", "DenseReduceScatter", "dense_allreduce", "dense_reduce_scatter",
           "dense_wire_bytes"]


def dense_wire_bytes(numel: int, element_size: int, world: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements (a dense step)."""
    return 2 * (world - 1) * numel * element_size // world


class _Dense(Algorithm):
    """No compression: every compressor "supports" it (there is nothing to encode)."""

    name = DENSE
    family = DENSE

    def supports(self, compressor) -> bool:
        return True


class DenseAllReduce(_Dense):
    """``x`` summed over the group in place (a ring allreduce's bytes)."""

    def __call__(self, comm, compressor, x, ctx, store, want: Want = PLAIN):
        return comm.all_reduce(x).then(_no_own)

    def wire_bytes(self, compressor, numel, dtype=torch.float32, world=2):
        return dense_wire_bytes(numel, torch.empty(0, dtype=dtype).element_size(), world)


class DenseReduceScatter(_Dense):
    """This rank's chunk of the sum of ``x`` (``world`` equal chunks)."""

    shard = True

    def __call__(self, comm, compressor, x, ctx, store, want: Want = PLAIN):
        return comm.reduce_scatter(x).then(_no_own)

    def wire_bytes(self, compressor, numel, dtype=torch.float32, world=2):
        return (world - 1) * (numel // world) * torch.empty(0, dtype=dtype).element_size()


def _no_own(f):
    return f.value(), None


dense_allreduce = DenseAllReduce()
dense_reduce_scatter = DenseReduceScatter()
