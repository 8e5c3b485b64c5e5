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

from typing import TYPE_CHECKING, ClassVar, Sequence

import torch

from .configured import Configured
from .context import Context
from .memory import PayloadPool, Workspace, block_elems

if TYPE_CHECKING:
    from .deferred import Deferred

__all__ = ["FAMILIES", "Compressor"]

FAMILIES = ("allreduce", "allgather", "two_phase", "shared_scale")


class Compressor(Configured):
    """Base class. Subclasses set ``name``/``families`` and implement the three methods.

    What identifies a compressor — its ``name`` and ``config()``, the spec string, equality,
    the example configurations the test matrices run — is :class:`Configured`'s.

    Attributes:
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
        """Elements per block of this compressor's blocked paths on ``device``: its ``block``
        when set (validated here, before any work), else :func:`block_elems`."""
        b = self.block if self.block is not None else block_elems(device)
        if b < 8 or b & (b - 1):
            raise ValueError(f"block must be a power of two >= 8, got {b!r}")
        return b

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
