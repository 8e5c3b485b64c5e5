"""``ErrorFeedback``: per-bucket residual memory, ``r <- (g + r) - D(C(g + r))``, and the
local velocity of Deep Gradient Compression's momentum correction.

Momentum correction (Lin et al., ICLR'18): with SGD momentum ``m`` moved from the optimizer
into the hook, each rank keeps a velocity ``u <- m u + g`` and compresses ``u + r`` instead
of ``g + r``; the optimizer then runs with momentum 0. Momentum factor masking zeroes ``u``
where the compressor sent a value (sparsifiers; :meth:`ErrorFeedback.mask_velocity_`, DGC's
rule), so a coordinate's stale momentum does not keep pushing after its accumulated mass went
out; given the aggregate, the same method zeroes it only where the aggregate held back what was
sent (the hook's default, "held"). Both are per rank and per bucket, in the units
the hook compresses (already divided by the world size); everything here runs before the
collective or on this rank's own decoded payload, so it is private arithmetic
(comms/ARCHITECTURE.md §5).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Sequence

import torch

from . import cpu_kernels
from .base import Compressor
from .context import Context
from .deferred import Deferred

__all__ = ["ErrorFeedback"]

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """Residual memory for any compressor, keyed by bucket index and layout.

    A residual is reused only while the bucket keeps its layout ``(numel, dtype)``; when DDP
    rebuilds its buckets the old residual is dropped (logged at debug) and a fresh zero one is
    used. Residuals are per rank and in the units the hook compresses (already divided by the
    world size).
    """

    __slots__ = ("residuals", "velocities", "last_amax", "draining", "layout_resets")

    def __init__(self):
        self.residuals: dict[int, torch.Tensor] = {}
        #: bucket -> dense steps left to drain its residual in (see :meth:`drain_step_`)
        self.draining: dict[int, int] = {}
        self.velocities: dict[int, torch.Tensor] = {}
        #: fp32 bits of the largest ``|x|`` the last compiled momentum / residual pass wrote
        #: (``None``: the torch path ran); the hook's non-finite check without another pass
        self.last_amax: int | None = None
        #: residuals and velocities dropped because their bucket changed layout (``report()``)
        self.layout_resets = 0

    def _layout_reset(self, what: str, bucket: int, old: torch.Tensor, new: torch.Tensor) -> None:
        self.layout_resets += 1
        msg = ("commpress: the %s of bucket %d was reset: its layout changed (%d %s -> %d %s), so "
               "what it held is lost (error feedback starts again from zero)")
        args = (what, bucket, old.numel(), old.dtype, new.numel(), new.dtype)
        if self.layout_resets == 1:
            logger.warning(msg + "; logged once, counted in layout_resets", *args)
        else:
            logger.debug(msg, *args)

    def residual(self, bucket: int, like: torch.Tensor) -> torch.Tensor | None:
        r = self.residuals.get(bucket)
        if r is None:
            return None
        if r.numel() != like.numel() or r.dtype != like.dtype or r.device != like.device:
            self._layout_reset("residual", bucket, r, like)
            del self.residuals[bucket]
            return None
        return r

    def add_residual_(self, bucket: int, x: torch.Tensor) -> torch.Tensor:
        """``x += residual`` in place (no-op when there is none yet); returns x."""
        r = self.residual(bucket, x)
        if r is not None:
            x.add_(r)
        return x

    def start_drain(self, bucket: int, steps: int) -> None:
        """The bucket moved to plain dense allreduce: its residual goes out over the next
        ``steps`` dense steps (:meth:`drain_step_`) instead of all in one."""
        if bucket in self.residuals:
            self.draining[bucket] = steps

    def drain_step_(self, bucket: int, x: torch.Tensor) -> torch.Tensor:
        """One dense step of a drain: ``x += r / n`` and ``r *= (n - 1) / n`` with ``n`` the
        steps left, so each of the ``steps`` dense steps adds an equal share of the residual
        the drain started with and the last one empties it (then it is dropped). Why not all
        at once: random-k's residual holds up to ``residual_bound`` (5) times a step's
        gradient; added into one dense step it is a 5x learning-rate step (loss spikes at
        every autotune switch to dense were seen). Returns x."""
        n = self.draining.get(bucket)
        if n is None:
            return x
        r = self.residual(bucket, x)
        if r is None:  # reset or re-laid out meanwhile
            del self.draining[bucket]
            return x
        x.add_(r, alpha=1.0 / n)
        if n <= 1:
            del self.residuals[bucket], self.draining[bucket]
        else:
            r.mul_((n - 1) / n)
            self.draining[bucket] = n - 1
        return x

    def _residual_buffer(self, bucket: int, x: torch.Tensor) -> torch.Tensor:
        r = self.residual(bucket, x)
        if r is None:
            r = torch.empty_like(x)
            self.residuals[bucket] = r
        return r

    def update_into_(self, bucket: int, x: torch.Tensor, own: Deferred, total: Deferred) -> torch.Tensor:
        """``update_(bucket, x, own)`` then ``total`` written into ``x``, in one pass where the
        decode has one (:meth:`~compressors.base.Deferred.into_with_residual_`); returns x."""
        return total.into_with_residual_(own, x, self._residual_buffer(bucket, x))

    def update_(self, bucket: int, x: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        """Store ``x - decoded`` as the bucket's residual, reusing its buffer (``decoded`` may
        be a :class:`~compressors.base.Deferred`: written without a decoded temporary)."""
        r = self._residual_buffer(bucket, x)
        if isinstance(decoded, Deferred):
            return decoded.residual_(x, r)
        torch.sub(x, decoded.to(x.dtype), out=r)
        return r

    def update_returned_(self, bucket: int, x: torch.Tensor, sent: torch.Tensor,
                         aggregate: torch.Tensor) -> torch.Tensor:
        """Store ``x - sent`` where the aggregate came back nonzero and ``x`` where it came
        back 0: what a second compression after the sum (two_phase's owner) left out of what
        this rank sent stays with this rank, as if it had not been sent (Shi et al.'s gTop-k
        rule); the algorithm then keeps no owner residual. Where the aggregate delivered, the
        bits of :meth:`update_`. A sum that cancels to exactly 0 returns every sender's part
        (their total is that 0: no mass is gained or lost)."""
        r = self._residual_buffer(bucket, x)
        sent = sent.to(x.dtype)
        torch.where(aggregate.ne(0), torch.sub(x, sent, out=r), x, out=r)
        return r

    def velocity(self, bucket: int, like: torch.Tensor) -> torch.Tensor | None:
        """The bucket's momentum-correction velocity, ``None`` if absent or of another layout."""
        u = self.velocities.get(bucket)
        if u is not None and (u.numel() != like.numel() or u.dtype != like.dtype
                              or u.device != like.device):
            self._layout_reset("velocity", bucket, u, like)
            del self.velocities[bucket]
            return None
        return u

    def momentum_(self, bucket: int, x: torch.Tensor, momentum: float, div: int = 1) -> torch.Tensor:
        """Momentum correction: ``x <- x / div`` (the world size; 1: none), then
        ``u <- momentum * u + x`` (``u = x`` the first time), then ``x <- u`` in place; returns
        x. ``mul_`` then ``add_``: two roundings, like ``torch.optim.SGD``'s
        ``buf.mul_(m).add_(g)``. One compiled pass over fp32 CPU buckets (same bits)."""
        u = self.velocity(bucket, x)
        if u is not None and (amax := _fused(x, u, None, div, momentum)) is not None:
            self.last_amax = amax
            return x
        if div != 1:
            x.div_(div)
        if u is None:
            self.velocities[bucket] = x.clone()
            return x
        u.mul_(momentum).add_(x)
        x.copy_(u)
        return x

    def momentum_residual_(self, bucket: int, x: torch.Tensor, momentum: float,
                           div: int = 1) -> torch.Tensor:
        """:meth:`momentum_` then :meth:`add_residual_` in one pass fewer: ``x <- u + r``
        written once instead of ``x <- u; x += r`` (same bits: one rounding either way)."""
        u, r = self.velocity(bucket, x), self.residual(bucket, x)
        if u is None or r is None:
            return self.add_residual_(bucket, self.momentum_(bucket, x, momentum, div))
        if (amax := _fused(x, u, r, div, momentum)) is not None:
            self.last_amax = amax
            return x
        if div != 1:
            x.div_(div)
        u.mul_(momentum).add_(x)
        return torch.add(u, r, out=x)

    def div_residual_(self, bucket: int, x: torch.Tensor, div: int = 1) -> torch.Tensor:
        """``x <- x / div + residual`` in place (``x.div_(div)`` then :meth:`add_residual_`), in
        one compiled pass over fp32 CPU buckets (same bits); returns x."""
        r = self.residual(bucket, x)
        c = None if r is None else _kernel_lib(x, r)
        if c is None:
            if div != 1:
                x.div_(div)
            return self.add_residual_(bucket, x)
        amax = ctypes.c_uint32(0)
        c.cp_div_add(x.data_ptr(), r.data_ptr(), x.numel(), float(div), ctypes.addressof(amax),
                     cpu_kernels.threads())
        self.last_amax = amax.value
        return x

    def update_masked_(self, bucket: int, x: torch.Tensor, sent: torch.Tensor,
                       aggregate: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`update_` (``sent`` as ``decoded``) then :meth:`mask_velocity_` with the same
        ``aggregate``, in one compiled pass over fp32 CPU buckets (same bits); returns the
        residual."""
        u = self.velocities.get(bucket)
        if u is not None and (u.numel() != x.numel()
                              or (aggregate is not None and aggregate.numel() != x.numel())):
            u = None  # mask_velocity_ skips a velocity of another layout too
        r = self.residual(bucket, x)
        ts = (x, sent) + tuple(t for t in (aggregate, r, u) if t is not None)
        c = _kernel_lib(*ts)
        if c is None or r is None:  # the torch steps (and the first step's allocation)
            self.mask_velocity_(bucket, sent, aggregate)
            return self.update_(bucket, x, sent)
        c.cp_ef_update(x.data_ptr(), sent.data_ptr(),
                       None if aggregate is None or u is None else aggregate.data_ptr(),
                       r.data_ptr(), None if u is None else u.data_ptr(), x.numel(),
                       cpu_kernels.threads())
        return r

    def mask_velocity_(self, bucket: int, sent: torch.Tensor,
                       aggregate: torch.Tensor | None = None) -> None:
        """Momentum factor masking (``sent``: this rank's own decoded payload, nonzero where the
        sparsifier sent a value):

        - ``aggregate`` None, DGC's rule ("sent"): ``u[sent != 0] = 0``;
        - ``aggregate`` given ("held", the hook's default where the algorithm can hold back):
          ``u[(sent != 0) & (aggregate == 0)] = 0``, only where the decoded sum every rank
          received came back without what this rank sent. A coordinate whose sum cancels to
          exactly 0 counts as held back too (rare; masking it only drops its momentum).

        A velocity of another layout is left alone."""
        u = self.velocities.get(bucket)
        if u is None or u.numel() != sent.numel():
            return
        if aggregate is None:
            u.masked_fill_(sent != 0, 0)
        elif aggregate.numel() == sent.numel():
            u.masked_fill_(torch.ne(sent, 0).logical_and_(torch.eq(aggregate, 0)), 0)

    def reset(self, bucket: int | None = None) -> None:
        if bucket is None:
            self.residuals.clear()
            self.velocities.clear()
            self.draining.clear()
        else:
            self.residuals.pop(bucket, None)
            self.velocities.pop(bucket, None)
            self.draining.pop(bucket, None)

    def compress(self, compressor: Compressor, x: torch.Tensor, ctx: Context
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One local EF round: returns (payload, own decoded); updates the residual.

        ``x`` is not modified.
        """
        r = self.residual(ctx.bucket, x)
        x = x.clone() if r is None else torch.add(x, r)  # one pass, same bits as clone + add_
        payload = compressor.compress(x, ctx)
        decoded = compressor.decompress(payload, ctx)
        self.update_(ctx.bucket, x, decoded)
        return payload, decoded

    def state_dict(self) -> dict:
        return {"residuals": {int(k): v.detach().cpu().clone() for k, v in self.residuals.items()},
                "velocities": {int(k): v.detach().cpu().clone() for k, v in self.velocities.items()},
                "draining": {int(k): int(n) for k, n in self.draining.items()}}

    def load_state_dict(self, sd: dict, device=None) -> None:
        def load(d):
            return {int(k): v.to(device) if device is not None else v.clone() for k, v in d.items()}

        self.residuals = load(sd.get("residuals", {}))
        self.velocities = load(sd.get("velocities", {}))
        self.draining = {int(k): int(n) for k, n in sd.get("draining", {}).items()}


def _kernel_lib(*ts: torch.Tensor):
    """The compiled kernels when every tensor is contiguous fp32 on the CPU, else None."""
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in ts):
        return None
    return cpu_kernels.lib(*ts)


def _fused(x: torch.Tensor, u: torch.Tensor, r: torch.Tensor | None, div: int,
           momentum: float) -> int | None:
    """``x / div``, the velocity update and ``x <- u (+ r)`` in one compiled pass (fp32 CPU,
    contiguous); returns the fp32 bits of the largest ``|x|`` written, or None where the
    torch path must do it. The bits are the torch path's
    (tests/unit/test_cpu_kernels.py): the pass exists because the torch path reads and writes
    a bucket-sized tensor four to five times (div, mul, add, copy), which on a 25M-parameter
    bucket is tens of ms per step even where auto locked dense."""
    c = _kernel_lib(*((x, u) if r is None else (x, u, r)))
    if c is None:
        return None
    amax = ctypes.c_uint32(0)
    c.cp_momentum(x.data_ptr(), u.data_ptr(), None if r is None else r.data_ptr(), x.numel(),
                  float(div), float(momentum), ctypes.addressof(amax), cpu_kernels.threads())
    return amax.value
