"""What a bucket in Adam's momentum space carries (:mod:`comms.core.adam`): its :class:`Share` of
the shared momentum and preconditioner, the per-bucket cache of the preconditioner
(:class:`Preconditioner`), and the factor the training loop applies to ``.grad`` between
backward and the step (:class:`LoopFactor`).

All arithmetic after a collective is elementwise on tensors with the same bits on every rank
(ARCHITECTURE.md §5); the probe reads one element, the same one on every rank.
"""

from __future__ import annotations

import torch

from .adam_steps import denominator

__all__ = ["Share", "Preconditioner", "LoopFactor", "EMPTY"]

#: the momentum of a share that does not read it (no bucket-sized copy)
EMPTY = torch.zeros(0)


class Share:
    """What the DDP hook hands the pipeline for a bucket in momentum space: the shared momentum
    in the travelling coordinates (:data:`EMPTY` where not read), the preconditioner (``None``
    without one), both flat over the bucket, and how the aggregate becomes the new momentum.

    Args:
        momentum, pre: the flat tensors.
        mode, beta1, rho: :class:`~comms.core.adam.FrozenVarianceAdam`'s.
    """

    __slots__ = ("momentum", "pre", "mode", "beta1", "rho")

    def __init__(self, momentum: torch.Tensor, pre: torch.Tensor | None, mode: str = "shared",
                 beta1: float = 0.9, rho: float = 0.0):
        self.momentum, self.pre = momentum, pre
        self.mode, self.beta1, self.rho = mode, beta1, rho

    def cut(self, segs) -> "Share":
        """The share of the ``(offset, numel)`` segments of the bucket, concatenated."""
        def part(t):
            return t if t is None or t.numel() == 0 else torch.cat([t[o: o + n] for o, n in segs])
        return Share(part(self.momentum), part(self.pre), self.mode, self.beta1, self.rho)

    def deliver_(self, x: torch.Tensor) -> torch.Tensor:
        """The aggregate ``A`` in ``x`` as the bucket's new momentum, in place (after the
        collective): ``(A + rho mbar) / pre`` (``"shared"``), ``(1 - beta1) A / pre``
        (``"local"``); returns ``x``."""
        if self.mode == "shared" and self.rho:
            x.add_(self.momentum, alpha=self.rho)
        elif self.mode == "local":
            x.mul_(1.0 - self.beta1)
        return x if self.pre is None else x.div_(self.pre)


class Preconditioner:
    """``1 / (sqrt(vhat) + eps)`` per bucket, flat, cached until one of its parameters'
    variance changes (:meth:`changed`). ``vstep(p)`` gives the step a frozen variance was
    last updated at."""

    def __init__(self, optimizer, beta2: float, vstep):
        self.optimizer, self.beta2, self.vstep = optimizer, beta2, vstep
        self._cache: dict = {}    # bucket key -> (its variances' versions, flat preconditioner)
        self._version: dict = {}  # param -> how often its variance changed since the freeze

    def changed(self, p=None) -> None:
        """``p``'s variance changed (``None``: any might have: forget everything)."""
        if p is None:
            self._cache.clear()
        else:
            self._version[p] = self._version.get(p, 0) + 1

    def __call__(self, params) -> torch.Tensor:
        key = tuple(id(p) for p in params)
        version = tuple(self._version.get(p, 0) for p in params)
        hit = self._cache.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        eps = {id(p): float(g["eps"]) for g in self.optimizer.param_groups for p in g["params"]}
        parts = []
        for p in params:
            st = self.optimizer.state.get(p)
            if not st or "exp_avg_sq" not in st:
                parts.append(torch.ones(p.numel(), dtype=p.dtype, device=p.device))
                continue
            s = self.vstep(p, float(st["step"]))
            parts.append(denominator(st["exp_avg_sq"], s, self.beta2, eps[id(p)]).reciprocal_().reshape(-1))
        pre = torch.cat(parts) if parts else EMPTY
        self._cache[key] = (version, pre)
        return pre


class LoopFactor:
    """The factor the training loop applies to every ``.grad`` between backward and the step
    (``clip_grad_norm_``, ``GradScaler.unscale_``): one element of one fixed bucket's delivered
    result is noted (:meth:`probe`) and compared with ``.grad`` before the step
    (:meth:`seen`). No host sync.

    Attributes:
        scale: the factor at the last dense step (a 0-d fp32 tensor; 1 before any).
    """

    def __init__(self):
        self.scale = torch.ones(())
        self._probe: tuple = (-1, None)  # (hook step, (param, flat index, value delivered))

    def probe(self, params, x: torch.Tensor, step: int) -> torch.Tensor:
        """Note the largest element of the largest parameter's first 65536 in the delivered
        ``x`` (a bucket of ``params``) at hook step ``step``; returns ``x``. Called for one
        fixed bucket: the factor's last bits depend on the element."""
        if self._probe[0] == step or not len(params):
            return x
        off, best = 0, None
        for p in params:
            if best is None or p.numel() > best[1].numel():
                best = (off, p)
            off += p.numel()
        if off != x.numel():
            return x
        window = x[best[0]: best[0] + min(best[1].numel(), 65536)]
        j = window.abs().argmax()
        self._probe = (step, (best[1], j, window[j].clone()))
        return x

    def seen(self, step: int, fallback: torch.Tensor) -> torch.Tensor | None:
        """``grad[j] / delivered[j]`` for hook step ``step``'s probe (``fallback`` where the
        delivered element is 0; ``None`` without a probe of this step)."""
        if self._probe[0] != step or self._probe[1] is None:
            return None
        p, j, value = self._probe[1]
        if p.grad is None:
            return None
        got = p.grad.detach().reshape(-1)[j]
        return torch.where(value != 0, got / value, fallback.to(value.device, value.dtype))
