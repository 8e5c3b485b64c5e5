"""``allgather``: the gather family — every rank's payload to every rank, decoded and summed
in rank order (so the floating-point sum is the same on all ranks).

Traffic per rank grows as O(world). Variable-size payloads exchange their sizes first; a
rank whose bucket layout differs from the others is detected there and every rank raises.
"""

from __future__ import annotations

import logging

import torch

from compressors.deferred import Deferred

from ..transport.errors import advice, where
from . import buffers
from .base import Algorithm, PLAIN, Want, decode_own, hand_over, round_wait
from .wire import from_bytes, layout_of, nbytes_of, to_bytes

__all__ = ["Allgather", "allgather", "GatheredSum"]

logger = logging.getLogger(__name__)


def _sum_in_rank_order(compressor, ctx, payloads, acc=None):
    """Decode every payload and add it into zeros, rank 0 first (``acc``: zeros of
    ``ctx.dtype`` to sum into, fp32/fp64 buckets only)."""
    acc_dtype = torch.float32 if ctx.dtype in (torch.float16, torch.bfloat16) else ctx.dtype
    if acc is None:
        acc = buffers.zeros(ctx.numel, acc_dtype, ctx.device)
    for r, p in enumerate(payloads):
        compressor.decompress_add_(p, ctx.with_(rank=r, dtype=acc_dtype), acc)
    return acc if acc_dtype == ctx.dtype else acc.to(ctx.dtype)


class GatheredSum(Deferred):
    """Every rank's payload, decoded and summed in rank order only where the hook writes it:
    :meth:`into_` zeroes the bucket and adds each payload into it — the bits of the sum into
    zeros and its copy into the bucket, without the bucket-sized temporary and the copy (a
    bucket of fp16/bf16, summed in fp32, takes the materialized path)."""

    __slots__ = ("compressor", "ctx", "payloads")

    def __init__(self, compressor, ctx, payloads):
        self.compressor, self.ctx, self.payloads = compressor, ctx, payloads

    def materialize(self) -> torch.Tensor:
        return _sum_in_rank_order(self.compressor, self.ctx, self.payloads)

    def into_(self, out: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        if (ctx.dtype in (torch.float16, torch.bfloat16) or out.dtype != ctx.dtype
                or not out.is_contiguous() or out.numel() != ctx.numel or out.device != ctx.device):
            return out.copy_(self.materialize())
        _sum_in_rank_order(self.compressor, ctx, self.payloads, acc=out.view(-1).zero_())
        return out


def _gathered(compressor, ctx, payloads, deferred):
    return GatheredSum(compressor, ctx, payloads) if deferred else _sum_in_rank_order(compressor, ctx, payloads)


def _allgather(comm, compressor, x, ctx, store, deferred=False, own=True, on_own=None):
    """Allgather the compressed payloads, decode each, sum in rank order (``deferred``: the
    sum comes back as a :class:`GatheredSum`, and ``own`` as the compressor's
    :meth:`~compressors.base.Compressor.deferred_own` where it has one; ``own`` False: it
    comes back as None, never decoded; ``on_own``: handed to it while the round is on the
    wire, and None comes back)."""
    wanted = own
    payload = compressor.compress(x, ctx)
    layout = layout_of(payload)
    buf = to_bytes(payload)
    world = comm.world_size

    def own_now():  # run while the payload round is on the wire (it only reads the payload)
        return hand_over(decode_own(compressor, x, payload, ctx, deferred), on_own) if wanted else None

    if compressor.fixed_size:
        nbytes = buf.numel()
        fut = comm.all_gather(buf)
        own = own_now()

        def done(fut):
            g = fut.value().view(world, nbytes)
            return _gathered(compressor, ctx, [from_bytes(g[r], layout) for r in range(world)], deferred), own

        return fut.then(done)

    # variable size: exchange (numel of each payload tensor, bucket numel) first
    sizes = torch.tensor([n for n, _ in layout] + [ctx.numel], dtype=torch.int64)
    if buf.device.type != "cpu":
        sizes = sizes.to(buf.device)

    def after_sizes(all_sizes):
        table = all_sizes.view(world, len(layout) + 1).cpu().tolist()  # host sync: sizes needed to slice
        if table[comm.rank] != sizes.tolist() or any(n < 0 for row in table for n in row):
            # gloo can hand back garbage instead of an error once a peer died: not a user error
            raise RuntimeError(f"{where(comm, 'allgather size-exchange round', ctx.bucket, ctx.numel, ctx.dtype, ctx.step)} "
                               f"returned a corrupt table: a peer died or disconnected; {advice()}")
        bad = [r for r, row in enumerate(table) if row[-1] != ctx.numel]
        if bad:
            raise ValueError(f"commpress: bucket {ctx.bucket}: numel differs across ranks "
                             f"({[row[-1] for row in table]}); every rank must build the same buckets")
        layouts = [tuple((n, dt) for n, (_, dt) in zip(row[:-1], layout)) for row in table]
        width = max(nbytes_of(lay) for lay in layouts)
        padded = torch.zeros(width, dtype=torch.uint8, device=buf.device)
        padded[: buf.numel()] = buf
        fut = comm.all_gather(padded)
        own = own_now()

        def done(fut):
            g = fut.value().view(world, width)
            ps = [from_bytes(g[r], layouts[r]) for r in range(world)]
            return _gathered(compressor, ctx, ps, deferred), own

        return fut.then(done)

    # wait for the size round here, in the caller's thread: starting the payload round from a
    # completion callback could order it after another bucket's first round on some ranks
    # only, and gloo pairs collectives by issue order
    return after_sizes(round_wait(comm, comm.all_gather(sizes), ctx, "allgather size-exchange round"))


class Allgather(Algorithm):
    """Every rank's payload to every rank; decode each and sum in rank order."""

    name = "allgather"
    family = "allgather"
    def __call__(self, comm, compressor, x, ctx, store, want: Want = PLAIN):
        """``want.deferred``: the sum comes back as a :class:`GatheredSum`, decoded straight
        where it goes; ``want.own`` False: this rank's own contribution is not decoded (None);
        ``want.on_own``: given it while the payload round is on the wire (``x`` unchanged
        until the result is used), and None comes back in its place."""
        return _allgather(comm, compressor, x, ctx, store, want.deferred, want.own, want.on_own)

    def wire_bytes(self, compressor, numel, dtype=torch.float32, world=2):
        return (world - 1) * compressor.wire_bytes(numel, dtype)

    def bucket_wire_bytes(self, compressor, ctx, world):
        shaped = getattr(compressor, "shaped_wire_bytes", None)
        if shaped is not None and ctx.known_shapes():  # tensor-aligned scales (sign, QSGD)
            return (world - 1) * shaped(ctx.known_shapes(), ctx.dtype)
        return self.wire_bytes(compressor, ctx.numel, ctx.dtype, world)

    def wire_ops(self, model, compressor, numel, dtype, tier="flat"):
        return [(tier, "allgather", str(torch.uint8), compressor.wire_bytes(numel, dtype))]

    def cost(self, model, compressor, numel, dtype, tier="flat"):
        cc, t = model.compute_for(compressor), model.tiers[tier]
        # every rank adds every payload into one zeroed bucket (the first add costs a decode)
        return (cc.compress(numel) + t.allgather(compressor.wire_bytes(numel, dtype), torch.uint8)
                + cc.decompress(numel) * (1 + (t.world - 1) * compressor.decode_add_share()))


allgather = Allgather()
