"""``ErrorFeedback``: per-bucket residual memory, ``r <- (g + r) - D(C(g + r))``.

Residuals are per rank and per bucket, in the units the caller compresses; everything here
runs before the collective or on this rank's own decoded payload, so it is private
arithmetic (comms/ARCHITECTURE.md §5). The training policies that act on the same memory
(momentum correction, momentum masking, the residual drain) live in
:mod:`comms.core.memory`.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from . import cpu_kernels
from .base import Compressor
from .context import Context
from .deferred import Deferred

__all__ = ["ErrorFeedback", "kernel_lib", "load_tensors"]

logger = logging.getLogger(__name__)


class ErrorFeedback:
    """Residual memory for any compressor, keyed by bucket index and layout.

    A residual is reused only while the bucket keeps its layout ``(numel, dtype)``; when DDP
    rebuilds its buckets the old residual is dropped (logged at debug) and a fresh zero one is
    used. Residuals are per rank and in the units the hook compresses (already divided by the
    world size).
    """

    __slots__ = ("residuals", "last_amax", "layout_resets")

    def __init__(self):
        self.residuals: dict[int, torch.Tensor] = {}
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

    def div_residual_(self, bucket: int, x: torch.Tensor, div: int = 1) -> torch.Tensor:
        """``x <- x / div + residual`` in place (``x.div_(div)`` then :meth:`add_residual_`), in
        one compiled pass over fp32 CPU buckets (same bits); returns x."""
        r = self.residual(bucket, x)
        c = None if r is None else kernel_lib(x, r)
        if c is None:
            if div != 1:
                x.div_(div)
            return self.add_residual_(bucket, x)
        amax = ctypes.c_uint32(0)
        c.cp_div_add(x.data_ptr(), r.data_ptr(), x.numel(), float(div), ctypes.addressof(amax),
                     cpu_kernels.threads())
        self.last_amax = amax.value
        return x

    def reset(self, bucket: int | None = None) -> None:
        """Forget every residual, or ``bucket``'s."""
        if bucket is None:
            self.residuals.clear()
        else:
            self.residuals.pop(bucket, None)

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
        return {"residuals": _plain_tensors(self.residuals)}

    def load_state_dict(self, sd: dict, device=None) -> None:
        self.residuals = load_tensors(sd.get("residuals", {}), device)


def kernel_lib(*ts: torch.Tensor):
    """The compiled kernels when every tensor is contiguous fp32 on the CPU, else None."""
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in ts):
        return None
    return cpu_kernels.lib(*ts)



def _plain_tensors(d: dict) -> dict:
    return {int(k): v.detach().cpu().clone() for k, v in d.items()}


def load_tensors(d: dict, device=None) -> dict:
    """``{int: tensor}`` from a state dict, moved to ``device`` (``None``: copied)."""
    return {int(k): v.to(device) if device is not None else v.clone() for k, v in d.items()}
