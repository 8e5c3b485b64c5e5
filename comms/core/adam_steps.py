"""The optimizer-side arithmetic of Adam's momentum space: the frozen-variance step, the
refresh step, the thaw before AdamW's own step, and the freeze statistic.

State layout: a parameter's ``torch.optim.AdamW`` state (``step``, ``exp_avg``,
``exp_avg_sq``) plus ``s``, the step its variance was last updated at (kept by
:class:`comms.core.adam.FrozenVarianceAdam`); while frozen its bias-corrected variance is
``vhat = exp_avg_sq / (1 - beta2^s)``. Every function here is elementwise IEEE arithmetic in a
fixed order on tensors that hold the same bits on every rank (ARCHITECTURE.md §5), except
:func:`variance_change`, whose sums are agreed on before they decide anything.
"""

from __future__ import annotations

import torch

__all__ = ["denominator", "frozen_step_", "refresh_step_", "thaw_", "variance_change"]


def denominator(v: torch.Tensor, s: float, beta2: float, eps: float) -> torch.Tensor:
    """``sqrt(v / (1 - beta2^s)) + eps``: AdamW's denominator with the variance of step ``s``."""
    return v.div(1.0 - beta2 ** s).sqrt_().add_(eps)


def _decay_and_apply_(p, m, denom, group: dict, t: float, beta1: float) -> None:
    """AdamW's decoupled weight decay, then ``p -= lr m / denom / (1 - beta1^t)``."""
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    if wd:
        p.mul_(1.0 - lr * wd)
    p.sub_(m.div(denom).mul_(lr / (1.0 - beta1 ** t)))


def frozen_step_(p: torch.Tensor, st: dict, group: dict, m_new: torch.Tensor, s: float,
                 beta1: float, beta2: float) -> None:
    """One frozen-variance step: ``exp_avg <- m_new`` (the momentum the exchange delivered),
    then AdamW's step with the variance of step ``s``; ``exp_avg_sq`` is not touched."""
    st["step"] += 1
    t = float(st["step"])
    m = st["exp_avg"]
    m.copy_(m_new)
    _decay_and_apply_(p, m, denominator(st["exp_avg_sq"], s, beta2, float(group["eps"])), group, t, beta1)


def refresh_step_(p: torch.Tensor, st: dict, group: dict, g: torch.Tensor, s: float,
                  beta1: float, beta2: float) -> None:
    """A refresh: the dense gradient ``g``'s square stands for the ``k = t - s`` steps since
    the variance's last update, ``v <- beta2^k v + (1 - beta2^k) g^2`` (``v`` as it was at step
    ``s``: the frozen steps did not touch it), ``m <- beta1 m + (1 - beta1) g``, then AdamW's
    step. For ``k = 1`` this is AdamW's own update (not its bits)."""
    st["step"] += 1
    t = float(st["step"])
    k = t - s
    v, m = st["exp_avg_sq"], st["exp_avg"]
    v.mul_(beta2 ** k).add_(g.mul(g), alpha=1.0 - beta2 ** k)
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    _decay_and_apply_(p, m, denominator(v, t, beta2, float(group["eps"])), group, t, beta1)


def thaw_(st: dict, s: float, beta2: float) -> None:
    """Before AdamW's own step on a parameter frozen since step ``s``: ``exp_avg_sq`` as if every
    step since had added ``vhat`` (``v <- vhat (1 - beta2^t)``, ``t`` the step count now), so
    ``vhat`` is continuous and AdamW goes on from a state of its own."""
    t = float(st["step"])
    if s != t:
        st["exp_avg_sq"].mul_((1.0 - beta2 ** t) / (1.0 - beta2 ** s))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP2: this rank's shard


def variance_change(optimizer, beta2: float) -> tuple[float, float]:
    """Before a dense Adam step: this rank's ``sum |vhat_new - vhat_old|`` and ``sum vhat_new``
    over every parameter with a gradient (FSDP: over its shards). A parameter without a
    variance yet counts as ``(1, 1)`` (everything moves)."""
    change = total = 0.0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            st = optimizer.state.get(p)
            if not st or "exp_avg_sq" not in st:
                change, total = change + 1.0, total + 1.0
                continue
            t = float(st["step"])
            g, old = _local(p.grad), _local(st["exp_avg_sq"])
            new = old.mul(beta2).add_(g.mul(g), alpha=1.0 - beta2).div_(1.0 - beta2 ** (t + 1))
            total += float(new.sum(dtype=torch.float64))
            change += float(new.sub_(old.div(1.0 - beta2 ** t)).abs_().sum(dtype=torch.float64))
    return change, total
