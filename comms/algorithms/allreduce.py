"""``allreduce``: the linear family — payloads are summed elementwise by allreduce.

Cost does not grow with world size. Used by FP16/BF16 casts, RandomK (shared indices),
Identity (one allreduce of the payload, decoded once), and by compressors with
``allreduce_rounds == 2`` (PowerSGD): ``P`` summed and waited for in the caller's thread,
then ``Q`` asynchronously — both issued in program order (ARCHITECTURE.md §2).

Bytes per rank: the ring allreduce's ``2 (W-1)/W`` of the payload (per layer for PowerSGD
when the bucket's shapes are known).

Example::

    >>> state = comms.register(ddp_model, "fp16", algorithm="allreduce")
"""

from __future__ import annotations

import logging

import torch

from compressors import Context
from compressors.deferred import Deferred

from . import buffers
from .base import PLAIN, Algorithm, Want, decode_own, hand_over, round_wait
from .wire import layout_of

__all__ = ["Allreduce", "allreduce", "payload_dtype"]

logger = logging.getLogger(__name__)

_PAYLOAD_DTYPES: dict[tuple, torch.dtype] = {}


def payload_dtype(comp, dtype=torch.float32) -> torch.dtype:
    """The dtype the allreduce sums for ``comp`` (one compress of a small sample; memoised).
    Multi-round compressors (PowerSGD) sum factors of the bucket dtype."""
    key = (comp.spec(), str(dtype))
    got = _PAYLOAD_DTYPES.get(key)
    if got is not None:
        return got
    got = dtype
    if comp.allreduce_rounds == 1 and comp.supports("allreduce"):
        try:
            x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(dtype)
            kinds = {t.dtype for t in comp.compress(x, Context(numel=4096, dtype=dtype, device=x.device))}
            if len(kinds) == 1:
                got = kinds.pop()
        except Exception:  # noqa: BLE001 - a compressor that cannot compress here: bucket dtype
            logger.debug("payload dtype of %s unknown; assuming %s", comp.spec(), dtype, exc_info=True)
    _PAYLOAD_DTYPES[key] = got
    return got


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _power_iteration(comm, compressor, x, ctx, store, deferred=False):
    """Two allreduces (``P`` then ``Q``) of the power-iteration protocol; see the docstring.
    ``deferred``: the decodes come back as :class:`compressors.base.Deferred` results."""
    rnd = compressor.first_round(x, ctx, store)
    if rnd is None:  # nothing worth factorizing: dense, own == x so the residual is zero
        wire = buffers.empty(x.numel(), x.dtype, x.device).copy_(x.detach().reshape(-1))
        return comm.all_reduce(wire).then(lambda f: (f.value(), x))
    # intermediate round: waited here, in program order (bounded: comms.transport.deadline)
    round_wait(comm, comm.all_reduce(rnd.p), ctx, "PowerSGD P allreduce round")
    q = compressor.second_round(rnd)
    q_own = compressor.q_factors(rnd, q).clone()  # the allreduce sums q in place
    fut = comm.all_reduce(q)
    # deferred: written later by the hook where they go (no decoded temporaries)
    decode = compressor.deferred_decode if deferred else compressor.decode_round
    own = decode(rnd, q_own, own=True)  # overlaps the Q round

    def done(f):
        summed = f.value()
        compressor.keep(rnd, summed, store)
        return decode(rnd, summed), own

    return fut.then(done)


class Allreduce(Algorithm):
    """Compress, sum the payload with one allreduce (two for PowerSGD), decode the sum once."""

    name = "allreduce"
    family = "allreduce"
    def __call__(self, comm, compressor, x, ctx, store, want: Want = PLAIN):
        """``want.deferred``: ``(sum, own)`` may come back as :class:`compressors.base.Deferred`
        results — a two-round compressor's decodes, and a single-round compressor's where it
        offers them (:meth:`~compressors.base.Compressor.deferred_own`, ``deferred_sum``: the
        casts, whose residual and aggregate are then written in one pass over the bucket).
        ``want.own`` False: a single-round compressor's ``own`` comes back as None, never
        decoded. ``want.on_own``: a single-round compressor's ``own`` is handed to it while the
        round is on the wire (two-round compressors return ``own``)."""
        deferred, on_own = want.deferred, want.on_own
        if compressor.allreduce_rounds == 2:
            return _power_iteration(comm, compressor, x, ctx, store, deferred)
        payload = compressor.compress(x, ctx)
        own = decode_own(compressor, x, payload, ctx, deferred) if want.own else None
        dtypes = {t.dtype for t in payload}
        if len(dtypes) != 1:
            raise TypeError(f"{compressor.name} payload mixes dtypes {sorted(map(str, dtypes))}; "
                            "the allreduce family needs one summable dtype")
        layout = layout_of(payload)
        if len(payload) == 1 and not _shares_memory(payload[0], x) and (
                own is None or isinstance(own, Deferred) or not _shares_memory(payload[0], own)):
            wire = payload[0].reshape(-1)
        else:  # the allreduce works in place: never sum into x or own's memory
            wire = torch.cat([t.reshape(-1) for t in payload])

        def done(fut):
            summed, off = [], 0
            for n, _ in layout:
                summed.append(wire[off: off + n])
                off += n
            total = compressor.deferred_sum(summed, ctx) if deferred else None
            if total is None:
                total = compressor.decompress_into(summed, ctx, buffers.empty(ctx.numel, ctx.dtype, wire.device))
            return total, own

        fut = comm.all_reduce(wire)
        own = hand_over(own, on_own)  # done() reads it when the round completes
        return fut.then(done)

    def wire_bytes(self, compressor, numel, dtype=torch.float32, world=2):
        return 2 * (world - 1) * compressor.wire_bytes(numel, dtype) // world

    def bucket_wire_bytes(self, compressor, ctx, world):
        shaped = getattr(compressor, "shaped_wire_bytes", None)
        if shaped is not None and ctx.known_shapes():
            # per-tensor payloads (PowerSGD per layer): the ring allreduce of their bytes
            return 2 * (world - 1) * shaped(ctx.known_shapes(), ctx.dtype) // world
        return self.wire_bytes(compressor, ctx.numel, ctx.dtype, world)

    def wire_ops(self, model, compressor, numel, dtype, tier="flat"):
        return [(tier, "allreduce", str(payload_dtype(compressor, dtype)), compressor.wire_bytes(numel, dtype))]

    def cost(self, model, compressor, numel, dtype, tier="flat"):
        cc = model.compute_for(compressor)
        t = model.tiers[tier]
        return (cc.compress(numel) + t.allreduce(compressor.wire_bytes(numel, dtype), payload_dtype(compressor, dtype))
                + cc.decompress(numel))


allreduce = Allreduce()
