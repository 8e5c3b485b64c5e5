"""``two_phase``: compressed scatter-reduce then compressed allgather — O(1) traffic per rank.

Steps for a bucket of ``n`` elements on ``W`` ranks (chunk ``m = ceil(n / W)``, the last
chunk zero-padded so every chunk payload has the same byte size):

1. every rank compresses its ``W`` chunks (chunk ``j`` with its own hash-RNG stream:
   ``bucket`` is re-keyed per (phase, chunk), ``rank`` stays the rank's own);
2. ``all_to_all`` the payloads: rank ``j`` receives every rank's chunk ``j``;
3. the owner ``j`` decodes and sums them **in rank order** (fp32, or fp64 for fp64 buckets),
   adds its *owner-side* error-feedback residual (``store["two_phase_residual"]``, reset when
   the layout changes; used for biased compressors — unbiased ones re-compress without it so
   the result stays unbiased), and re-compresses the sum. With ``return_held`` (the hook, for
   a sparsifier with error feedback) the owner keeps no residual: each sender keeps the values
   it sent that the owner's re-compression left out (they come back 0 in the aggregate),
   Shi et al.'s gTop-k rule — no bytes added, and that coordinate's momentum goes on like an
   unsent one's instead of pushing while the owner holds its value;
4. ``all_gather`` the owners' payloads; every rank, the owner too, decodes every owner's
   payload — so all ranks hold the same bits.

When the context knows the bucket's parameter shapes, each chunk's context carries the tensor
pieces it holds (:func:`chunk_shapes`), so a tensor-aligned codec (sign, QSGD) restarts its
scales at every tensor inside a chunk, as it does on the other algorithms; chunks that hold
different pieces then have payloads of slightly different sizes, which go zero-padded to the
largest on the wire (:class:`ChunkWire`).

``own`` (for the caller's first-stage error feedback) is the concatenation of this rank's
decoded phase-1 chunks. Bytes sent per rank: ``2 (W-1) P + 16 (W-1)`` where ``P`` is one
chunk's (padded) payload and 16 the layout header.

Rounds are issued from the caller's thread in program order and the intermediate ones are
waited for there; only the final all_gather is asynchronous. A round issued from a
completion callback would race with the next bucket's first round on another thread and
mismatch collectives across ranks (the reason torch's PowerSGD hook fails on gloo with
several buckets).

Example::

    >>> state = comms.register(ddp_model, "qsgd:bits=8", algorithm="two_phase")
"""

from __future__ import annotations

import functools
import logging
import math

import torch


from compressors.deferred import Deferred

from . import cuda_kernels as cuda_dispatch, buffers
from .base import Algorithm, PLAIN, Want, hand_over, round_wait
from .layout_check import HEADER_BYTES, check_same_layout
from .wire import from_bytes, layout_of, nbytes_of, to_bytes

__all__ = ["TwoPhase", "two_phase", "OwnerChunks", "chunk_context", "chunk_shapes", "ChunkWire", "scatter_send", "decode_sum", "two_phase_error_bound"]

logger = logging.getLogger(__name__)

_RESIDUAL = "two_phase_residual"


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


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk(x: torch.Tensor, j: int, m: int) -> torch.Tensor:
    lo, hi = j * m, min(x.numel(), (j + 1) * m)
    if hi - lo == m:
        return x[lo:hi]
    out = x.new_zeros(m)
    if hi > lo:
        out[: hi - lo] = x[lo:hi]
    return out


def _owner_ef(compressor) -> bool:
    return not compressor.unbiased


def _need_fixed_size(compressor) -> None:
    if not compressor.fixed_size:
        raise TypeError(f"two_phase needs a fixed-size compressor (equal chunk payloads); "
                        f"{compressor.spec()!r} is variable-size")


def scatter_send(comm, compressor, x, ctx, tail: torch.Tensor | None = None, exact_own: bool = False):
    """Phase 1 of the scatter-reduce: compress ``x``'s ``W`` chunks, start the ``all_to_all``.

    Chunk ``j`` is compressed with this rank's private stream of
    ``chunk_context(ctx, W, 1, j, rank)`` and sent to rank ``j``. ``tail``: optional uint8
    bytes appended to every destination's payload (the FSDP reduce-scatter sends its
    non-finite flag this way: no extra collective). ``exact_own``: chunk ``rank`` stays home
    uncompressed — never encoded, its row of the exchange unused, its ``own`` slice ``x``
    itself (no error to feed back) — and :func:`decode_sum` adds it exactly: the codec does
    ``(W - 1) / W`` of the work, for a sum whose bits are still computed once, by the owner.

    Returns:
        ``(fut, own, layout, nb, stride)``: the future of the received bytes (rank ``i``'s
        payload for this rank's chunk at ``[i * stride, i * stride + nb)``, its tail after
        it), this rank's decoded chunks (``W * m`` elements, for first-stage error feedback),
        the payloads' :class:`ChunkWire` and byte sizes.
    """
    _need_fixed_size(compressor)
    world, rank, n = comm.world_size, comm.rank, x.numel()
    m = -(-n // world)
    # chunks without tensor pieces (a flat context) share one layout, so the skipped chunk's
    # layout is any other's; with pieces every chunk must be encoded (its layout sizes the wire)
    if exact_own and (world < 2 or len(ctx.known_shapes()) >= 2):
        raise ValueError("scatter_send: exact_own needs world >= 2 and a flat context (no tensor pieces)")
    sent = [j for j in range(world) if not (exact_own and j == rank)]
    payloads = {j: compressor.compress(_chunk(x, j, m), chunk_context(ctx, world, 1, j, rank))
                for j in sent}
    # a chunk's layout depends on its size and tensor pieces only: the same on every rank
    layout = ChunkWire([layout_of(payloads[j if j in payloads else sent[0]]) for j in range(world)])
    nb = layout.nbytes
    stride = nb + (0 if tail is None else tail.numel())
    send = buffers.empty(world * stride, torch.uint8, x.device)
    rows = send.view(world, stride)
    for j, p in payloads.items():
        layout.write(p, rows[j, :nb])
    if tail is not None:
        rows[:, nb:] = tail
    fut = comm.all_to_all(send)

    # while the exchange is in flight: this rank's decoded contribution, for first-stage EF
    own = buffers.empty(world * m, ctx.dtype, x.device)
    for j, p in payloads.items():
        compressor.decompress_into(p, chunk_context(ctx, world, 1, j, rank), own[j * m:(j + 1) * m])
    if exact_own:
        own[rank * m:(rank + 1) * m].copy_(_chunk(x, rank, m))
    return fut, own, layout, nb, stride


def decode_sum(compressor, recv: torch.Tensor, layout: ChunkWire, nb: int, stride: int, ctx, world: int,
               rank: int, exact: torch.Tensor | None = None) -> torch.Tensor:
    """The owner's sum of chunk ``rank``: decode every rank's payload and add them **in rank
    order** into zeros (fp32, fp64 for fp64 buckets) — one summation order on every run.
    ``exact``: this rank's own chunk, added as it is in place of its payload
    (:func:`scatter_send` with ``exact_own``)."""
    m = -(-ctx.numel // world)
    acc_dtype = _acc_dtype(ctx.dtype)
    acc = buffers.zeros(m, acc_dtype, recv.device)
    for i in range(world):
        if exact is not None and i == rank:
            acc.add_(exact)
            continue
        compressor.decompress_add_(layout.read(recv[i * stride:i * stride + nb], rank),
                                   chunk_context(ctx, world, 1, rank, i).with_(dtype=acc_dtype), acc)
    return acc


class OwnerChunks(Deferred):
    """The owners' allgathered phase-2 payloads, decoded chunk by chunk only where the hook
    writes them: :meth:`into_` decodes each chunk straight into its slice of the bucket (a
    short last chunk through a chunk-sized temporary, so its padding is never written) — the
    bits of the decoded sum and its copy, without both."""

    __slots__ = ("compressor", "ctx", "layout", "g", "nb2", "world", "m")

    def __init__(self, compressor, ctx, layout, g, nb2, world, m):
        self.compressor, self.ctx, self.layout, self.g = compressor, ctx, layout, g
        self.nb2, self.world, self.m = nb2, world, m

    def _decode(self, i, out):
        c, w = self.compressor, self.world
        return c.decompress_into(self.layout.read(self.g[i * self.nb2:(i + 1) * self.nb2], i),
                                 chunk_context(self.ctx, w, 2, i, i), out)

    def materialize(self) -> torch.Tensor:
        m = self.m
        out = buffers.empty(self.world * m, self.ctx.dtype, self.g.device)
        for i in range(self.world):  # the owner decodes its own payload from the wire, like everyone
            self._decode(i, out[i * m:(i + 1) * m])
        return out[:self.ctx.numel]

    def into_(self, out: torch.Tensor) -> torch.Tensor:
        n, m = self.ctx.numel, self.m
        if out.dtype != self.ctx.dtype or not out.is_contiguous() or out.numel() != n:
            return out.copy_(self.materialize())
        flat = out.view(-1)
        for i in range(self.world):
            lo, hi = i * m, min(n, (i + 1) * m)
            if hi - lo == m:
                self._decode(i, flat[lo:hi])
            elif hi > lo:
                flat[lo:hi].copy_(self._decode(i, buffers.empty(m, self.ctx.dtype, flat.device))[:hi - lo])
        return out


def _two_phase(comm, compressor, x, ctx, store, deferred=False, on_own=None, return_held=False):
    """Two-phase compressed allreduce of flat ``x``; see the module docstring. ``deferred``:
    the sum comes back as an :class:`OwnerChunks`; ``on_own``: this rank's phase-1 decode is
    handed to it while the phase-2 round is on the wire, and None comes back in its place;
    ``return_held``: the owner keeps no residual — the caller takes back, on each sender,
    what the owner's re-compression left out (sparsifiers only)."""
    _need_fixed_size(compressor)
    if return_held and not getattr(compressor, "sparsifies", False):
        raise ValueError(f"two_phase return_held needs a sparsifier (what was left out must be "
                         f"whole sent values); {compressor.spec()!r} is not one")
    world, rank, n = comm.world_size, comm.rank, x.numel()
    check_same_layout(comm, "two_phase", ctx)
    m = -(-n // world)
    if return_held and two_phase.flush_residual_(x, store, comm):
        store.pop(_RESIDUAL)  # an owner residual from before (a checkpoint): sent on by x once

    # phase 1: compress every chunk with this rank's private streams, exchange
    fut1, own, layout, nb, _ = scatter_send(comm, compressor, x, ctx)
    recv = round_wait(comm, fut1, ctx, "two_phase all_to_all round")  # intermediate round: see the module docstring
    ctx2 = chunk_context(ctx, world, 2, rank, rank)
    use_ef = _owner_ef(compressor) and not return_held
    # CUDA + QSGD: one fused kernel reads every rank's chunk once, sums in rank order and
    # re-quantizes (same bits as the torch path below); None: not applicable here
    p2 = (cuda_dispatch.two_phase_qsgd_owner(compressor, recv, world, m, ctx2)
          if recv.is_cuda and not use_ef and len(set(layout.chunks)) == 1 else None)
    if p2 is None:
        acc = decode_sum(compressor, recv, layout, nb, nb, ctx, world, rank)
        del recv
        owner_in = acc if acc.dtype == ctx.dtype else acc.to(ctx.dtype)
        if use_ef:
            res = store.get(_RESIDUAL)
            if res is not None and (res.numel() != m or res.dtype != ctx.dtype or res.device != x.device):
                logger.debug("two_phase: bucket %d layout changed; owner residual reset", ctx.bucket)
                res = None
            if res is not None:
                owner_in.add_(res)  # owner_in is a fresh tensor (acc or its cast)
        p2 = compressor.compress(owner_in, ctx2)
        if use_ef:
            res = store.get(_RESIDUAL)
            if res is None or res.numel() != m or res.dtype != ctx.dtype or res.device != x.device:
                res = store[_RESIDUAL] = torch.empty(m, dtype=ctx.dtype, device=x.device)
            torch.sub(owner_in, compressor.decompress_into(p2, ctx2, buffers.empty(m, ctx.dtype, x.device)),
                      out=res)
    # phase-2 chunk i holds the same pieces as phase-1 chunk i: the same layouts
    nb2 = layout.nbytes
    send2 = buffers.empty(nb2, torch.uint8, x.device)
    layout.write(p2, send2)
    fut2 = comm.all_gather(send2)
    mine = hand_over(own[:n], on_own)  # e.g. the residual, while the owners' payloads are on the wire

    def done(f):
        total = OwnerChunks(compressor, ctx, layout, f.value(), nb2, world, m)
        return (total if deferred else total.materialize()), mine

    return fut2.then(done)


def two_phase_error_bound(compressor, xs, dtype=None) -> torch.Tensor:
    """Per-element bound on ``|two_phase sum - sum(xs)|`` for a fresh ``store`` (fp64).

    Phase 1 contributes the sum of per-rank chunk bounds ``b1``; the owner's re-compression
    acts on a sum whose magnitude is at most ``|sum| + b1`` (bounds are monotone in ``|x|``),
    plus floating-point slack for the rank-order sums and casts.
    """
    world, n = len(xs), xs[0].numel()
    dtype = dtype or xs[0].dtype
    m = -(-n // world)
    eps = torch.finfo(dtype).eps
    parts = []
    for j in range(world):
        chunks = [_chunk(x, j, m) for x in xs]
        b1 = sum(compressor.error_bound(c).double() for c in chunks)
        absx = sum(c.double().abs() for c in chunks)
        y = sum(c.double() for c in chunks)
        b2 = compressor.error_bound((y.abs() + b1).to(dtype)).double()
        parts.append(b1 + b2 + (world + 2) * eps * (absx + b1 + b2))
    return torch.cat(parts)[:n]


class TwoPhase(Algorithm):
    """Compressed scatter-reduce then compressed allgather (see the module docstring)."""

    name = "two_phase"
    family = "two_phase"
    holds_back = True  # the owner's re-compression of the chunk sum keeps a residual
    compress_stages = 2  # each rank's chunks, then the owner's chunk sum
    def __call__(self, comm, compressor, x, ctx, store, want: Want = PLAIN):
        """``want.deferred``: the sum comes back as an :class:`OwnerChunks`, decoded straight
        where it goes; ``want.on_own``, ``want.return_held``: see :func:`_two_phase` (the
        phase-1 decode is made whatever ``want.own`` says: the exchange needs it)."""
        return _two_phase(comm, compressor, x, ctx, store, want.deferred, want.on_own, want.return_held)

    def wire_bytes(self, compressor, numel, dtype=torch.float32, world=2):
        m = -(-numel // world)
        return (world - 1) * (2 * compressor.wire_bytes(m, dtype) + HEADER_BYTES)

    def bucket_wire_bytes(self, compressor, ctx, world):
        """Tensor-aligned chunks (:func:`chunk_shapes`) pad their payloads to the largest."""
        layout = getattr(compressor, "payload_layout", None)
        if layout is None or world < 2 or not any(chunk_shapes(ctx, world, j) for j in range(world)):
            return self.wire_bytes(compressor, ctx.numel, ctx.dtype, world)
        wire = ChunkWire([layout(chunk_context(ctx, world, 1, j, 0)) for j in range(world)])
        return (world - 1) * (2 * wire.nbytes + HEADER_BYTES)

    def wire_ops(self, model, compressor, numel, dtype, tier="flat"):
        n = model.tiers[tier].world
        w = compressor.wire_bytes(-(-numel // n), dtype)
        u8 = str(torch.uint8)
        return [(tier, "all_to_all", u8, n * w), (tier, "allgather", u8, w)]

    def cost(self, model, compressor, numel, dtype, tier="flat"):
        cc, t = model.compute_for(compressor), model.tiers[tier]
        n = t.world
        m = -(-numel // n)
        wire = compressor.wire_bytes(m, dtype)
        owner_sum = cc.decompress(m) * (1 + (n - 1) * compressor.decode_add_share())
        return (cc.compress(numel) + t.all_to_all(n * wire, torch.uint8) + owner_sum  # phase 1
                + cc.compress(m) + t.allgather(wire, torch.uint8) + n * cc.decompress(m))  # owner + phase 2

    def flush_residual_(self, x, store, comm, numel=None):
        """Add the owner residual into ``x`` at this rank's chunk.

        The owner residual of rank ``r`` is compression error of chunk ``r`` of the *sum*;
        adding it into this rank's own ``x`` at that chunk puts it into the next sum exactly
        once, whatever moves ``x`` next. ``numel``: the logical bucket size the chunks were
        cut from (a hierarchical shard may be shorter at the end of the bucket).
        """
        res = store.get(_RESIDUAL)
        if res is None:
            return False
        m = -(-(x.numel() if numel is None else numel) // comm.world_size)
        lo = comm.rank * m
        hi = min(x.numel(), lo + m)
        if hi > lo and res.numel() >= hi - lo:
            x[lo:hi].add_(res[: hi - lo].to(x.dtype))
        return True

    error_bound = staticmethod(two_phase_error_bound)


two_phase = TwoPhase()
