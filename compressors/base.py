"""The ``Compressor`` interface: tensor -> payload (what goes on the wire) -> tensor.

Compressors are pure: no process groups, no communication, no DDP. They declare which
aggregation families (comms/ARCHITECTURE.md §3) can move their payloads:

* ``"allreduce"``  payload tensors can be summed elementwise (linear family);
* ``"allgather"``  payloads are rank specific: gather all, decode each, sum in rank order;
* ``"two_phase"``  compress chunks, all-to-all, decode-sum, re-compress, allgather;
* ``"shared_scale"`` quantize with a scale shared by all ranks, integer-sum allreduce.

Everything a receiver needs to decode another rank's payload is in the payload itself or
in the :class:`Context`, which all ranks share for a bucket (numel, dtype, step, bucket,
seed) — except ``rank``, which only private randomness (stochastic rounding) may use.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
from dataclasses import dataclass, field, replace
from typing import ClassVar, Sequence

import torch

__all__ = ["ScaledCodesDecoder", "ALIGNS", "check_align", "Context", "Compressor", "FAMILIES", "check_density", "check_chunk", "check_input",
           "Workspace", "block_elems", "chunk_pieces", "numpy_view", "fresh_empty", "PayloadPool",
           "Deferred", "SparseOwn", "materialized", "same_flat"]

logger = logging.getLogger(__name__)

FAMILIES = ("allreduce", "allgather", "two_phase", "shared_scale")


@dataclass(frozen=True)
class Context:
    """What compress and decompress of one bucket agree on.

    Args:
        numel: elements of the flat input.
        dtype: dtype of the input and of the decoded output.
        device: where the tensors live.
        step: training iteration (mixes into the hash RNG).
        bucket: bucket index (mixes into the hash RNG).
        rank: this rank; only private randomness may depend on it.
        seed: the seed every rank shares.
        shapes: shapes of the tensors that make up the flat input, in order (a DDP bucket's
            parameters); ``()`` means unknown: the input is one flat vector. Compressors that
            use it (PowerSGD per layer) go through :meth:`known_shapes`, which drops shapes
            that do not add up to ``numel`` (e.g. a shard of a hierarchical algorithm).
    """

    numel: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step: int = 0
    bucket: int = 0
    rank: int = 0
    seed: int = 0
    shapes: tuple = ()

    @classmethod
    def of(cls, x: torch.Tensor, **kw) -> "Context":
        return cls(numel=x.numel(), dtype=x.dtype, device=x.device, **kw)

    def with_(self, **kw) -> "Context":
        return replace(self, **kw)

    def known_shapes(self) -> tuple:
        """``shapes`` as a tuple of int tuples when they tile exactly ``numel`` elements, else ``()``."""
        if not self.shapes:
            return ()
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        return shapes if sum(math.prod(s) for s in shapes) == self.numel else ()


def check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"gradients must be floating point, got dtype {x.dtype}")


def check_density(density) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise TypeError(f"density must be a number, got {density!r}")
    if not (0.0 < float(density) <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def check_chunk(chunk) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise TypeError(f"chunk must be an int, got {chunk!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk!r}")
    return chunk


def block_elems(device: torch.device) -> int:
    """Elements per block of the blocked fast paths (a power of two).

    CPU: 512K elements (2 MiB per fp32 scratch buffer, a few of them: L3-resident); blocks
    must be large enough that torch's per-op dispatch cost does not dominate (the measurement
    behind the choice: bench/results/compressors.md, "Measurements behind compressors/").
    Elsewhere (CUDA) blocks are larger still, so that few kernels are launched.
    """
    return 1 << 19 if torch.device(device).type == "cpu" else 1 << 22


_HUGE_MIN_BYTES = 2 << 20  # one transparent huge page
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def fresh_empty(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A new, uninitialised 1-D tensor that nothing else references (payloads, outputs).

    On Linux CPU, tensors of 2 MB and more come from their own anonymous mmap advised for
    transparent huge pages (freed with the tensor), so that the first touch of a fresh payload
    takes a fraction of the page faults of 4 KB pages (figures: bench/results/compressors.md).
    Elsewhere ``torch.empty``.
    """
    nbytes = n * dtype.itemsize
    if (_MADV_HUGEPAGE is None or nbytes < _HUGE_MIN_BYTES
            or torch.device(device).type != "cpu"):
        return torch.empty(n, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(_MADV_HUGEPAGE)
    except OSError:  # pragma: no cover - kernels without THP: plain pages
        pass
    return torch.frombuffer(buf, dtype=dtype, count=n)


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unreferenced(alias: torch.Tensor) -> bool:
    """True when only ``alias`` (and the temporary storage object of this check) holds its
    storage: no tensor, view, numpy array, DLPack capsule or collective's work object anywhere
    else can still read or write the memory."""
    return _storage_use_count(alias.untyped_storage()._cdata) <= 2


class PayloadPool:
    """Payload tensors that are reused only once nobody references them any more.

    ``compress`` returns fresh tensors (the hook may still be sending the previous step's
    payload while the next one is built). A fresh large payload costs page faults on first
    touch, even with huge pages, so this pool keeps a private alias of each large
    payload it hands out and gives the memory out again only when that alias is the last
    reference to its storage (torch's storage use count: every tensor, view, ``.numpy()``
    array, DLPack export and gloo/NCCL work object holding the payload counts). To the caller
    a payload is indistinguishable from a fresh one. CPU only, >= 2 MB, at most
    ``per_key`` buffers per (size, dtype); without the use-count API it is ``fresh_empty``.
    """

    def __init__(self, per_key: int = 4):
        self.per_key = per_key
        self._lock = threading.Lock()
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def empty(self, n: int, dtype: torch.dtype, device) -> torch.Tensor:
        if (_storage_use_count is None or torch.device(device).type != "cpu"
                or n * dtype.itemsize < _HUGE_MIN_BYTES):
            return fresh_empty(n, dtype, device)
        key = (n, dtype)
        with self._lock:
            aliases = self._free.setdefault(key, [])
            for a in aliases:
                if _unreferenced(a):
                    return a.detach()  # a new tensor object on the same memory
            t = fresh_empty(n, dtype, device)
            if len(aliases) < self.per_key:
                aliases.append(t.detach())
            return t

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    def __reduce__(self):
        return (PayloadPool, (self.per_key,))

    def __deepcopy__(self, memo):
        return PayloadPool(self.per_key)


_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64, torch.int32, torch.int64,
                 torch.int16, torch.uint8, torch.bool)


def numpy_view(t: torch.Tensor):
    """A numpy array sharing ``t``'s memory when ``t`` is a contiguous CPU tensor of a dtype
    numpy has (not bfloat16), else None. Some CPU ops (``>=``, ``nonzero``) are much cheaper
    in numpy on the same memory (figures: bench/results/compressors.md)."""
    if t.device.type != "cpu" or t.dtype not in _NUMPY_DTYPES or not t.is_contiguous():
        return None
    return t.detach().numpy()


def chunk_pieces(b0: int, b1: int, chunk: int):
    """Split ``[b0, b1)`` at chunk boundaries: yields ``(lo, hi, ci, rows)``.

    ``rows > 0``: ``[lo, hi)`` is ``rows`` whole chunks starting with chunk ``ci`` (view it as
    ``(rows, chunk)``); ``rows == 0``: ``[lo, hi)`` is part of chunk ``ci`` (or a short last chunk).
    """
    pos = b0
    while pos < b1:
        ci, off = divmod(pos, chunk)
        if off == 0 and b1 - pos >= chunk:
            rows = (b1 - pos) // chunk
            yield pos, pos + rows * chunk, ci, rows
            pos += rows * chunk
        else:
            hi = min(b1, (ci + 1) * chunk)
            yield pos, hi, ci, 0
            pos = hi


class Workspace:
    """Scratch buffers reused across calls, so hot paths do not page-fault fresh memory.

    Buffers are per thread (DDP runs future callbacks on backend threads, so two calls on one
    compressor may overlap) and grow to the largest size requested. They never leave the
    compressor: payloads and decoded outputs returned to callers are fresh tensors (or the
    caller's own ``out``). Copying or pickling a compressor gives it an empty workspace.

    .. warning::
        Only CPU buffers are reused. On CUDA one thread runs DDP's future callbacks on
        different streams (each ``then`` callback gets a pool stream), so a reused buffer would
        be written on one stream while a kernel on another still reads it; on an H200 that
        changed the averaged gradient from run to run. torch's caching allocator already
        reuses memory per stream, and a fresh CUDA tensor costs no page faults.
    """

    def __init__(self):
        self._local = threading.local()

    def get(self, name: str, n: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A 1-D buffer of ``n`` elements (contents undefined), reused by later calls on CPU;
        fresh from torch's caching allocator on other devices (see the class warning)."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(max(n, 1), dtype=dtype, device=device)[:n]
        bufs = self._local.__dict__.setdefault("bufs", {})
        key = (name, dtype, device)
        buf = bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=dtype, device=device)
            bufs[key] = buf
        return buf[:n]

    def iota(self, n: int, device) -> torch.Tensor:
        """``arange(n)`` int32, computed once per thread on CPU, then reused (read only); fresh
        on other devices."""
        if torch.device(device).type != "cpu":
            return torch.arange(max(n, 1), dtype=torch.int32, device=device)[:n]
        bufs = self._local.__dict__.setdefault("bufs", {})
        key = ("<iota>", torch.int32, torch.device(device))
        buf = bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.arange(max(n, 1), dtype=torch.int32, device=device)
            bufs[key] = buf
        return buf[:n]

    def clear(self) -> None:
        self._local.__dict__.pop("bufs", None)

    def __reduce__(self):
        return (Workspace, ())

    def __deepcopy__(self, memo):
        return Workspace()

    def __repr__(self) -> str:
        return "Workspace()"


class Compressor:
    """Base class. Subclasses set ``name``/``families`` and implement the three methods.

    Attributes:
        name: registry name (``compressors.get(name)``).
        families: aggregation families that can move this compressor's payloads.
        lossless: decompress(compress(x)) == x exactly.
        fixed_size: payload shapes depend only on ``ctx.numel`` and ``ctx.shapes`` (no size
            exchange needed).
        unbiased: E[decompress(compress(x))] == x over the hash-RNG streams.
        sparsifies: decompress is zero wherever no value was sent (top-k, random-k): the
            hook's momentum factor masking reads the nonzeros of a rank's own decoded payload
            as what it sent (and, by default, zeroes the velocity only where the aggregate
            came back 0 there: ``CompressionState``'s ``momentum_masking``).
        momentum_correction: with SGD momentum, ``comms.register(..., optimizer=opt)`` moves
            the momentum into the hook and applies it before compression (Deep Gradient
            Compression's momentum correction) — True for the element-wise compressors, whose
            error feedback diverges against an optimizer's momentum. False (PowerSGD): the
            optimizer keeps its momentum and applies it to the averaged, decoded gradient
            (PowerSGD's own pairing and torch's hook).
        default_warmup_steps: ``CompressionState``'s ``warmup_steps="auto"``: how many
            compressed steps ramp to this compressor through :meth:`warmup` (0: none).
        allreduce_rounds: 1: one payload summed by one allreduce (the linear family's
            default); 2: the power-iteration protocol of :class:`compressors.PowerSGD`
            (``first_round``, ``second_round``, ``decode_round``, ``keep``).

    A compressor of the ``shared_scale`` family exposes ``bits``, ``chunk`` and
    ``chunk_absmax(x)`` (per-chunk max-abs scales): what the shared-scale integer allreduce
    (``comms.algorithms.shared_scale``) quantizes with.
    """

    name: ClassVar[str] = "base"
    families: ClassVar[tuple[str, ...]] = ()
    lossless: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    unbiased: ClassVar[bool] = False
    sparsifies: ClassVar[bool] = False
    momentum_correction: ClassVar[bool] = True
    default_warmup_steps: ClassVar[int] = 0
    allreduce_rounds: ClassVar[int] = 1

    #: elements per block in blocked fast paths (a power of two >= 8); None: block_elems(device)
    block: int | None = None

    # -- the interface ---------------------------------------------------------------
    def compress(self, x: torch.Tensor, ctx: Context) -> list[torch.Tensor]:
        """Encode flat ``x`` into the tensors that go on the wire."""
        raise NotImplementedError

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Context) -> torch.Tensor:
        """Decode a payload (own or another rank's) into a flat tensor of ``ctx.dtype``."""
        raise NotImplementedError

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes this compressor puts on the wire for an input of ``numel`` elements."""
        raise NotImplementedError

    # -- helpers with sensible defaults -------------------------------------------------
    def decode_add_share(self) -> float:
        """What one :meth:`decompress_add_` of a bucket's payload costs as a share of one
        :meth:`decompress` (the cost model's decode-and-sum terms: an allgather adds every
        rank's payload into one zeroed bucket): 1 for a codec that decodes every element; a
        sparsifier's add touches its payload's elements only (its density), where its
        measured :meth:`decompress` also fills the whole bucket with zeros."""
        return float(getattr(self, "density", 1.0)) if self.sparsifies else 1.0

    def decompress_add_(self, payload: Sequence[torch.Tensor], ctx: Context,
                        acc: torch.Tensor) -> torch.Tensor:
        """``acc += decompress(payload)``; sparse compressors override to skip the dense temp."""
        return acc.add_(self.decompress(payload, ctx))

    def decompress_into(self, payload: Sequence[torch.Tensor], ctx: Context,
                        out: torch.Tensor) -> torch.Tensor:
        """``out.copy_(decompress(payload, ctx))`` without a fresh ``numel``-sized tensor.

        Same bits as that expression (``out`` may have another dtype than ``ctx.dtype``: the
        decoded values are rounded to ``ctx.dtype`` first). Returns ``out``. Compressors with a
        blocked fast path override it; a fresh result page-faults on its first touch on CPU,
        so hot paths should decode into a reused buffer.
        """
        return out.copy_(self.decompress(payload, ctx))

    def deferred_own(self, x: torch.Tensor, payload: Sequence[torch.Tensor],
                     ctx: Context) -> "Deferred | None":
        """This rank's decoded contribution (``payload = compress(x, ctx)``) as a
        :class:`Deferred` that an algorithm hands back instead of decoding it now, or None
        (the default): decode now. It may read ``x`` when used, so ``x`` must be unchanged
        until then (the hook writes ``x`` only after the residual is read)."""
        return None

    def deferred_sum(self, summed: Sequence[torch.Tensor], ctx: Context) -> "Deferred | None":
        """The decode of an allreduce-summed payload as a :class:`Deferred` (written where the
        hook says), or None (the default): decode now."""
        return None

    def workspace(self) -> Workspace:
        """This compressor's reusable scratch buffers (created on first use)."""
        ws = self.__dict__.get("_ws")
        if ws is None:
            ws = self.__dict__["_ws"] = Workspace()
        return ws

    def payload_pool(self) -> PayloadPool:
        """Where this compressor's large payload tensors come from (see :class:`PayloadPool`)."""
        pool = self.__dict__.get("_pool")
        if pool is None:
            pool = self.__dict__["_pool"] = PayloadPool()
        return pool

    def block_for(self, device) -> int:
        b = self.block if self.block is not None else block_elems(device)
        if b < 8 or b & (b - 1):
            raise ValueError(f"block must be a power of two >= 8, got {b!r}")
        return b

    def _decode_blocks(self, ctx: Context, out: torch.Tensor, accumulate: bool, device,
                       decode_block) -> torch.Tensor:
        """Run ``decode_block(b0, b1, f)`` (fills fp32 ``f`` with elements ``[b0, b1)``) over
        blocks, writing ``out[b0:b1] = f`` or adding it, with the bits of
        ``out.copy_(decompress(...))`` / ``out.add_(decompress(...))``: values are rounded to
        ``ctx.dtype`` first, as ``decompress`` returns them. ``out`` is flat and contiguous."""
        n = ctx.numel
        if out.numel() != n:
            raise ValueError(f"output has {out.numel()} elements, context says {n}")
        B = self.block_for(device)
        cap = min(B, n)
        ws = self.workspace()
        direct = not accumulate and out.dtype == torch.float32 and ctx.dtype == torch.float32
        for b0 in range(0, n, B):
            b1 = min(n, b0 + B)
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

    def config(self) -> dict:
        """Constructor arguments, for specs, state dicts and the cross-rank config check."""
        return {}

    # -- test matrices ----------------------------------------------------------------
    # tests/unit/test_compressor_roundtrip.py and tests/dist/algo_ranks.py build their cases
    # from these over compressors.REGISTRY, so a new compressor is tested by registering it
    @classmethod
    def examples(cls) -> list["Compressor"]:
        """A few small representative configurations (e.g. ``[QSGD(8), QSGD(4), QSGD(2)]``):
        every test matrix runs each of them, the distributed ones with every algorithm the
        compressor supports, so keep it short. Default: the default configuration."""
        return [cls()]

    @classmethod
    def edge_examples(cls) -> list["Compressor"]:
        """Extra configurations for the single-process round-trip tests only: settings at the
        edges of the codec (lossless densities, odd chunk sizes). Default: none."""
        return []

    def spec(self) -> str:
        cfg = self.config()
        if not cfg:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_fmt(v)}" for k, v in cfg.items())

    def warmup(self, fraction: float) -> "Compressor":
        """A milder variant for warm-up step ``fraction`` in (0, 1) of the ramp to this one
        (Deep Gradient Compression's warm-up; ``CompressionState(warmup_steps=...)``).
        Default: no milder variant (``self``). Sparsifiers ramp the density exponentially,
        QSGD sends 8 bits in the first half."""
        return self

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound on ``|decompress(compress(x)) - x|`` for one round trip."""
        return x.abs()

    def supports(self, family: str) -> bool:
        return family in self.families

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.config().items()))))


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)


class Deferred:
    """A bucket-sized decoded result not written anywhere yet.

    Returned (for this rank's own contribution and the aggregate) by an algorithm called with
    ``deferred=True`` (the hook, where the algorithm's ``deferred_results`` says it can): the
    hook writes the residual ``x - own`` and the aggregate straight into their buffers, which
    saves a bucket-sized temporary and a copy per result. Every method gives the bits of the
    materialized tensor."""

    def materialize(self) -> torch.Tensor:
        """The values as a flat tensor of the bucket dtype."""
        raise NotImplementedError

    def into_(self, out: torch.Tensor) -> torch.Tensor:
        """``out.copy_(self.materialize())``; returns ``out``."""
        return out.copy_(self.materialize())

    def residual_(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``torch.sub(x, self.materialize(), out=r)``; returns ``r``."""
        return torch.sub(x, self.materialize().to(x.dtype), out=r)

    def into_with_residual_(self, own: "Deferred", x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """``own.residual_(x, r)`` then ``self.into_(x)`` (this is the aggregate, ``own`` this
        rank's part of the same round); a subclass may do both in one pass. Returns ``x``."""
        own.residual_(x, r)
        return self.into_(x)


def same_flat(x: torch.Tensor, ref: torch.Tensor, r: torch.Tensor) -> bool:
    """``x`` is ``ref``'s memory (the tensor a Deferred was made from) and ``x``, ``r`` are
    contiguous tensors of one size and dtype: a fused pass over them may read ``ref`` as ``x``."""
    n = ref.numel()
    return (x.data_ptr() == ref.data_ptr() and x.numel() == n and r.numel() == n and r.dtype == x.dtype
            and x.is_contiguous() and r.is_contiguous())


class SparseOwn(Deferred):
    """A sparsifier's own contribution: ``own[idx] = vals``, zero elsewhere (``vals`` the
    decoded values, bit for bit what the decode writes). Its residual ``x - own`` is ``x`` off
    the indices: :meth:`residual_` copies ``x`` and subtracts at ``idx`` only — no decoded
    bucket-sized temporary and one pass fewer (the same bits, -0, inf and quiet NaN included,
    since ``v - (+0) = v``)."""

    __slots__ = ("x", "idx", "vals")

    def __init__(self, x: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor):
        self.x, self.idx, self.vals = x, idx, vals

    def materialize(self) -> torch.Tensor:
        return torch.zeros(self.x.numel(), dtype=self.x.dtype, device=self.x.device).index_copy_(
            0, self.idx, self.vals)

    def residual_(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        if not same_flat(x, self.x, r):
            return super().residual_(x, r)
        xf, rf = x.view(-1), r.view(-1)
        rf.copy_(xf)
        if self.idx.numel():
            rf.index_copy_(0, self.idx, torch.index_select(xf, 0, self.idx) - self.vals)
        return r


def materialized(t):
    """``t`` as a tensor (a :class:`Deferred` is materialized)."""
    return t.materialize() if isinstance(t, Deferred) else t


ALIGNS = ("tensor", "flat")


def check_align(align) -> str:
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align!r}")
    return align


class ScaledCodesDecoder(Compressor):
    """Codecs whose payload is ``[scales, packed codes]`` with one scale per chunk (QSGD,
    ScaledSign): each subclass implements ``_compress_flat(x, ctx)`` and
    ``_decode(payload, ctx, out, accumulate)`` for a flat vector, ``code_bits`` and ``chunk``,
    and names its CUDA launchers in ``_cuda_decompress`` / ``_cuda_decompress_add_``
    (``compressors.cuda.dispatch`` functions returning None when they do not apply).

    **Tensor-aligned chunks** (``align="tensor"``, issue 17): when the context knows the
    bucket's parameter shapes (``ctx.known_shapes()``, two or more tensors), the chunk grid
    restarts at every tensor, so no scale straddles two tensors (a LayerNorm gain no longer
    shares a scale with the neighbouring weight's entries). Payload: the tensors' flat
    payloads one after another — scales ``sum(ceil(n_i / chunk))``, codes
    ``sum(ceil(n_i * bits / 8))`` bytes. Private randomness (QSGD rounding) uses a stream per
    tensor. Without shapes (two-phase chunks, hierarchical shards, direct calls) the layout
    is the flat one: ``align="flat"`` behaviour.
    """

    _cuda_decompress = None
    _cuda_decompress_add_ = None
    align: str = "flat"
    code_bits: int = 8
    chunk: int = 1

    # -- tensor-aligned layout ----------------------------------------------------------
    def _segments(self, ctx):
        """``[(e0, e1, s0, s1, b0, b1)]`` element, scale and code-byte ranges per tensor, or
        ``None`` for the flat layout."""
        if self.align != "tensor" or len(ctx.shapes) < 2:
            return None
        shapes = ctx.known_shapes()
        if len(shapes) < 2:
            return None
        from .bitpack import packed_nbytes

        segs, e, sc, b = [], 0, 0, 0
        for sh in shapes:
            n = math.prod(sh)
            if n == 0:
                continue
            nc, nb = -(-n // self.chunk), packed_nbytes(n, self.code_bits)
            segs.append((e, e + n, sc, sc + nc, b, b + nb))
            e, sc, b = e + n, sc + nc, b + nb
        return segs if len(segs) > 1 else None

    def shaped_wire_bytes(self, shapes, dtype=torch.float32) -> int:
        """Bytes of one payload for a bucket of tensors of ``shapes`` (its own layout)."""
        segs = self._segments(Context(numel=sum(math.prod(s) for s in shapes), shapes=tuple(shapes)))
        if segs is None:
            return self.wire_bytes(sum(math.prod(s) for s in shapes), dtype)
        return 4 * segs[-1][3] + segs[-1][5]

    def payload_layout(self, ctx) -> tuple:
        """``((scales, float32), (code bytes, uint8))``: the payload :meth:`compress` returns
        for ``ctx`` (its size and, tensor-aligned, its shapes), without compressing."""
        from .bitpack import packed_nbytes

        segs = self._segments(ctx)
        if segs is None:
            return ((-(-ctx.numel // self.chunk), torch.float32),
                    (packed_nbytes(ctx.numel, self.code_bits), torch.uint8))
        return ((segs[-1][3], torch.float32), (segs[-1][5], torch.uint8))

    def _compress_flat(self, x, ctx):
        raise NotImplementedError

    def compress(self, x, ctx):
        segs = self._segments(ctx)
        if segs is None:
            return self._compress_flat(x, ctx)
        check_input(x)
        x = x.detach().reshape(-1)
        s = torch.empty(segs[-1][3], dtype=torch.float32, device=x.device)
        packed = self.payload_pool().empty(segs[-1][5], torch.uint8, x.device)
        for i, (e0, e1, s0, s1, b0, b1) in enumerate(segs):
            # a stream per tensor: rounding noise must not repeat from one tensor to the next
            sub = ctx.with_(numel=e1 - e0, shapes=(), bucket=(ctx.bucket * 0x9E3779B1 + i + 1) & 0xFFFFFFFF)
            ps, pp = self._compress_flat(x[e0:e1], sub)
            s[s0:s1].copy_(ps)
            packed[b0:b1].copy_(pp)
        return [s, packed]

    def _segmented_decode(self, payload, ctx, segs, out, accumulate):
        s, packed = payload
        for e0, e1, s0, s1, b0, b1 in segs:
            pk = packed[b0:b1]
            if pk.is_cuda:
                pk = pk.clone()  # kernels may expect an aligned code buffer
            sub = [s[s0:s1], pk]
            sctx = ctx.with_(numel=e1 - e0, shapes=())
            if accumulate:
                self.decompress_add_(sub, sctx, out[e0:e1])
            else:
                self.decompress_into(sub, sctx, out[e0:e1])
        return out

    def decompress(self, payload, ctx):
        segs = self._segments(ctx)
        if segs is not None:
            out = fresh_empty(ctx.numel, ctx.dtype, payload[1].device)
            return self._segmented_decode(payload, ctx, segs, out, False)
        if payload[1].is_cuda and (out := type(self)._cuda_decompress(self, payload, ctx)) is not None:
            return out
        out = fresh_empty(ctx.numel, ctx.dtype, payload[1].device)
        return self._decode(payload, ctx, out, accumulate=False)

    def decompress_into(self, payload, ctx, out):
        if not out.is_contiguous() or out.numel() != ctx.numel:
            return super().decompress_into(payload, ctx, out)
        segs = self._segments(ctx)
        if segs is not None:
            self._segmented_decode(payload, ctx, segs, out.view(-1), False)
            return out
        if out.is_cuda and payload[1].is_cuda and \
                type(self)._cuda_decompress(self, payload, ctx, out.view(-1)) is not None:
            return out  # the kernels' bits, decoded in place (error feedback's own decode)
        self._decode(payload, ctx, out.view(-1), accumulate=False)
        return out

    def decompress_add_(self, payload, ctx, acc):
        segs = self._segments(ctx)
        if segs is not None and acc.is_contiguous() and acc.numel() == ctx.numel:
            self._segmented_decode(payload, ctx, segs, acc.view(-1), True)
            return acc
        if segs is None and acc.is_cuda and \
                (out := type(self)._cuda_decompress_add_(self, payload, ctx, acc)) is not None:
            return out
        if not acc.is_contiguous() or acc.numel() != ctx.numel:
            return super().decompress_add_(payload, ctx, acc)
        self._decode(payload, ctx, acc.view(-1), accumulate=True)
        return acc
