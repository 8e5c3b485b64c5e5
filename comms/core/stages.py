"""The stages of the gradient pipeline, shared by every entry point.

A flat gradient — a DDP bucket, an FSDP module's unsharded gradient, an HSDP shard — becomes
the averaged result through the same named stages, whatever adapter drives them
(driven by :mod:`comms.core.engine` for DDP, FSDP2 and HSDP alike):

1. :func:`local_` — this rank's local steps, before any collective: its share of the
   average, clipping to ``clip_norm``, momentum correction (``u = m u + x``, ``x = u``).
2. :func:`feed_` — the local steps and error feedback (``x += r``, bounded by
   ``residual_bound``) in as few passes as the compiled kernels allow.
3. :func:`nonfinite_flag` — the non-finite flag of what is about to be sent (a tensor: no
   host sync); every rank learns every rank's flag and a flagged result is NaN everywhere.
4. :func:`warm_step_goes_dense` — during the warm-up ramp, whether the mild variant is
   better sent dense.
5. :class:`Delivery` / :func:`settle_` — after the algorithm: the residual
   ``r = x - own`` (or the give-back rule of algorithms that hold back), momentum factor
   masking, the aggregate written into ``x``.

``st`` is any state with the attributes of :class:`~comms.core.options.OptionsView` (the training
options) plus ``memory`` (a :class:`compressors.ErrorFeedback`). Everything here acts on this
rank's own share or its own decoded payload: private arithmetic (ARCHITECTURE.md §5).
"""

from __future__ import annotations

import functools
import struct

import torch

from compressors.deferred import Deferred, materialized

from ..algorithms.base import Want

__all__ = ["local_", "feed_", "local_flagged", "nonfinite_flag", "warm_step_goes_dense",
           "Delivery", "settle_", "WARM_DENSE_DENSITY"]

#: a warm-up variant that keeps more than this fraction of the elements goes dense: on CPU its
#: selection and decodes cost more than a dense step (docs/design-notes.md, "Top-k warm-up")
WARM_DENSE_DENSITY = 0.15

_FP32_MAX = 3.4028234663852886e38


def local_(st, index: int, x: torch.Tensor, div: int = 1, limit: float | None = None,
           mbar: torch.Tensor | None = None) -> None:
    """This rank's share ``x / div`` (``div``: the world size where the adapter averages),
    then the local steps, in place: clip the norm to ``limit`` (``clip_norm`` scaled to this
    rank's share), then momentum correction (``x <- u = m u + x``; with the division in one
    pass) — or, in Adam's momentum space (``mbar``: the bucket's
    :class:`~comms.core.adam_share.Share`), this rank's share of what travels
    (:meth:`comms.core.adam.FrozenVarianceAdam.momentum_`). No host sync (the clip factor stays a
    tensor)."""
    world = div
    if st.clip_norm is not None:
        if div != 1:
            x.div_(div)
            div = 1
        norm = torch.linalg.vector_norm(x, dtype=torch.float32)
        x.mul_(torch.clamp(limit / (norm + 1e-12), max=1.0).to(x.dtype))
    if mbar is not None:
        st.adam.momentum_(st.memory, index, x, mbar, div, world)
    elif st.momentum is not None:
        st.memory.momentum_(index, x, st.momentum, div)
    elif div != 1:
        x.div_(div)


def _no_local_steps(st, div: int, mbar) -> bool:
    """Whether :func:`local_` leaves ``x`` as it is (no share to take, no clip, no momentum)."""
    return div == 1 and st.clip_norm is None and mbar is None and st.momentum is None


def local_flagged(st, index: int, x: torch.Tensor, div: int, limit: float | None,
                  mbar: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`local_` on a dense step, then the non-finite flag of what it sends: a NaN that
    entered the velocity must reset it like a compressed step's would."""
    st.memory.last_amax = None
    local_(st, index, x, div, limit, mbar)
    return nonfinite_flag(x, st.memory.last_amax)


def feed_(st, index: int, x: torch.Tensor, div: int, limit: float | None,
          mbar: torch.Tensor | None = None, written: int | None = None) -> int | None:
    """The local steps and error feedback in place: ``x <- local(x) + r``, with ``x + r``
    scaled down to at most ``residual_bound * |local(x)|`` when a bound is set. One compiled
    pass where possible (the division, momentum and residual; the same bits as in turn).
    ``written``: the fp32 bits of the largest ``|x|`` as handed over (a compiled pass of the
    adapter wrote ``x``), or ``None``.

    Returns:
        The fp32 bits of the largest ``|x|`` the compiled pass wrote (for
        :func:`nonfinite_flag`) — ``written`` where nothing here rewrites ``x`` — or ``None``
        where the torch path ran.
    """
    mem, bound = st.memory, st.residual_bound
    fused = st.error_feedback and bound is None and st.clip_norm is None and mbar is None
    mem.last_amax = None
    if not st.error_feedback and _no_local_steps(st, div, mbar):
        return written
    if fused and st.momentum is not None:
        mem.momentum_residual_(index, x, st.momentum, div)
    elif fused:  # the division and the residual in one pass
        mem.div_residual_(index, x, div)
    else:
        local_(st, index, x, div, limit, mbar)
    if st.error_feedback and not fused:
        if bound is None:
            mem.add_residual_(index, x)
        else:  # x + r scaled down to at most bound * |x|: mass beyond it is dropped
            fresh = torch.linalg.vector_norm(x, dtype=torch.float32)
            mem.add_residual_(index, x)
            total = torch.linalg.vector_norm(x, dtype=torch.float32)
            x.mul_(torch.clamp(bound * fresh / (total + 1e-30), max=1.0).to(x.dtype))
    return mem.last_amax if fused else None


def nonfinite_flag(x: torch.Tensor, amax: int | None = None) -> torch.Tensor:
    """The flag of ``x`` (a 0-d bool tensor, not a bool: no host sync): NaN/Inf anywhere, or
    a finite ``x`` whose sum may overflow fp32 — from ``amax``, the max ``|x|`` a compiled
    pass that wrote ``x`` saw (no extra pass), else one fp32 sum over ``x``."""
    if amax is not None:
        return torch.tensor(_nonfinite_or_overflows(amax, x.numel()))
    return ~torch.isfinite(x.sum(dtype=torch.float32))


def _nonfinite_or_overflows(amax_bits: int, n: int) -> bool:
    """NaN or inf among the elements (``amax_bits``: the fp32 bits of the largest ``|x|``), or
    ``n * max|x|`` beyond fp32's range (a sum that could overflow)."""
    if amax_bits >= 0x7F800000:
        return True
    return struct.unpack("<f", struct.pack("<I", amax_bits))[0] * n > _FP32_MAX


def warm_step_goes_dense(compressor, wire_bytes: int, dense_bytes: int) -> bool:
    """A warm-up step sends the gradient dense when its mild variant keeps more than
    :data:`WARM_DENSE_DENSITY` of the elements or would send more than half a dense step's
    bytes; the quality the ramp buys comes from its first, near-dense steps, which a dense step
    gives as well."""
    if getattr(compressor, "density", 0.0) > WARM_DENSE_DENSITY:
        return True
    return 2 * wire_bytes > dense_bytes


class Delivery:
    """How one compressed step's result is settled, fixed before the algorithm runs.

    ``alg``: the algorithm about to run (whether its aggregate can hold back what a rank sent,
    whether it is a shard). ``masking``: the momentum-masking rule of the per-rank velocity
    (default: momentum correction's ``momentum_masking``, ``"off"`` without it; Adam's local
    momentum space passes ``"sent"``).

    Attributes:
        mask: DGC's momentum masking ("sent"): zero the velocity wherever this rank sent.
        mask_held: "held" masking: zero it where the aggregate left out what this rank sent
            (only algorithms that compress again after the sum can).
        give_back: a sparsifier with error feedback on an algorithm that holds back: what
            the second compression left out of this rank's values stays in this rank's
            residual (no owner residual), as if unsent.
        error_feedback: the residual ``x - own`` is kept.
        shard: the aggregate is this rank's chunk only: the caller places it, not ``x``.
    """

    __slots__ = ("mask", "mask_held", "give_back", "error_feedback", "shard")

    def __init__(self, st, compressor, alg, masking: str | None = None):
        sparsifies = getattr(compressor, "sparsifies", False)
        if masking is None:  # momentum correction's rule, where it keeps a velocity
            masking = st.momentum_masking if st.momentum is not None else "off"
        masking = masking if sparsifies else "off"
        self.error_feedback = st.error_feedback
        self.mask = masking == "sent"
        self.give_back = alg.holds_back and st.error_feedback and sparsifies
        self.mask_held = masking == "held" and alg.holds_back and not self.give_back
        self.shard = alg.shard

    @property
    def needs_own(self) -> bool:
        """Whether this rank's decoded contribution is needed after the collective."""
        return bool(self.error_feedback or self.mask or self.mask_held)

    def want(self, st, index: int, x: torch.Tensor, **more) -> Want:
        """What the algorithm is asked for (``more``: the caller's own fields, e.g. a
        reduce-scatter's ``exact_own`` and ``tail``)."""
        on_own = None
        if self.error_feedback and not (self.give_back or self.mask or self.mask_held):
            # the residual x - own, written while the payload is on the wire (x is unchanged
            # until settle_ writes the aggregate into it); own then comes back None
            on_own = functools.partial(st.memory.update_, index, x)
        return Want(deferred=True, own=self.needs_own, on_own=on_own, return_held=self.give_back, **more)


def settle_(st, index: int, x: torch.Tensor, total, own, d: Delivery):
    """After the algorithm: residual and momentum masking from ``x`` (what was fed in) and
    ``own`` (this rank's decoded contribution), then ``total`` (the aggregate, possibly a
    :class:`~compressors.deferred.Deferred`) written into ``x``; returns ``x`` — or, for a
    shard (``d.shard``), ``total`` itself, which the caller places."""
    mem = st.memory
    if d.give_back:  # before the aggregate goes into x
        own, total = materialized(own), materialized(total)
        if d.mask:
            mem.mask_velocity_(index, own)
        mem.update_returned_(index, x, own, total)
    elif d.mask or d.mask_held:
        own = materialized(own)
        held = None
        if d.mask_held:
            held = total = materialized(total)
        if d.error_feedback:  # residual and masking in one pass
            mem.update_masked_(index, x, own, held)
        else:
            mem.mask_velocity_(index, own, held)
    elif d.shard:
        if d.error_feedback and own is not None:
            mem.update_(index, x, own)
    elif d.error_feedback and isinstance(own, Deferred) and isinstance(total, Deferred):
        return mem.update_into_(index, x, own, total)  # x read once, written once
    elif d.error_feedback and own is not None:  # None: written already (on_own)
        mem.update_(index, x, own)
    if d.shard:
        return total
    if isinstance(total, Deferred):
        total.into_(x)  # decoded straight into x (after the residual read it)
    elif total is not x:
        x.copy_(total)
    return x
