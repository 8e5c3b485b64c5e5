"""``LocalMemory``: the error-feedback memory plus the local-step policies that act on it —
Deep Gradient Compression's momentum correction, momentum factor masking and the residual drain.

Momentum correction (Lin et al., ICLR'18): with SGD momentum ``m`` moved from the optimizer
into the pipeline, each rank keeps a velocity ``u <- m u + g`` and compresses ``u + r`` instead
of ``g + r``; the optimizer then runs with momentum 0. Momentum factor masking zeroes ``u``
where the compressor sent a value (sparsifiers; :meth:`LocalMemory.mask_velocity_`, DGC's
rule), so a coordinate's stale momentum does not keep pushing after its accumulated mass went
out; given the aggregate, the same method zeroes it only where the aggregate held back what was
sent (the default, "held"). Both are per rank and per bucket, in the units the pipeline
compresses; everything here is private arithmetic (comms/ARCHITECTURE.md §5).
"""

from __future__ import annotations

import ctypes

import torch

from compressors import ErrorFeedback, cpu_kernels
from compressors.error_feedback import kernel_lib, load_tensors

__all__ = ["LocalMemory"]


class LocalMemory(ErrorFeedback):
    """:class:`compressors.ErrorFeedback` plus per-bucket velocities and residual drains."""

    __slots__ = ("velocities", "draining")

    def __init__(self):
        super().__init__()
        #: bucket -> dense steps left to drain its residual in (see :meth:`drain_step_`)
        self.draining: dict[int, int] = {}
        self.velocities: dict[int, torch.Tensor] = {}

    def reset(self, bucket: int | None = None) -> None:
        """Forget every residual, velocity and drain, or ``bucket``'s."""
        super().reset(bucket)
        if bucket is None:
            self.velocities.clear()
            self.draining.clear()
        else:
            self.velocities.pop(bucket, None)
            self.draining.pop(bucket, None)

    def state_dict(self) -> dict:
        return {**super().state_dict(),
                "velocities": {int(k): v.detach().cpu().clone() for k, v in self.velocities.items()},
                "draining": {int(k): int(n) for k, n in self.draining.items()}}

    def load_state_dict(self, sd: dict, device=None) -> None:
        super().load_state_dict(sd, device)
        self.velocities = load_tensors(sd.get("velocities", {}), device)
        self.draining = {int(k): int(n) for k, n in sd.get("draining", {}).items()}

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
        c = kernel_lib(*ts)
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



def _fused(x: torch.Tensor, u: torch.Tensor, r: torch.Tensor | None, div: int,
           momentum: float) -> int | None:
    """``x / div``, the velocity update and ``x <- u (+ r)`` in one compiled pass (fp32 CPU,
    contiguous); returns the fp32 bits of the largest ``|x|`` written, or None where the
    torch path must do it. The bits are the torch path's
    (tests/unit/test_cpu_kernels.py): the pass exists because the torch path reads and writes
    a bucket-sized tensor four to five times (div, mul, add, copy), which on a 25M-parameter
    bucket is tens of ms per step even where auto locked dense."""
    c = kernel_lib(*((x, u) if r is None else (x, u, r)))
    if c is None:
        return None
    amax = ctypes.c_uint32(0)
    c.cp_momentum(x.data_ptr(), u.data_ptr(), None if r is None else r.data_ptr(), x.numel(),
                  float(div), float(momentum), ctypes.addressof(amax), cpu_kernels.threads())
    return amax.value
