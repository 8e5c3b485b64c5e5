"""Momentum-space compression for Adam(W): 1-bit Adam's frozen variance behind ``register``.

Error feedback is exact for optimizers linear in the gradient; Adam divides by ``sqrt(v)``,
which is not, and compressed gradients under Adam lose quality. 1-bit Adam (Tang et al., ICML
2021) moves the compression to the momentum: Adam runs with dense gradients while its variance
``v`` settles, then ``v`` is frozen and each rank's *momentum* is what travels:

* each rank forms ``m_i = beta1 * m + (1 - beta1) * g_i`` from the shared momentum ``m`` of the
  last step (the optimizer's ``exp_avg``, the same bits on every rank) and its own gradient;
* the pipeline compresses ``m_i / world`` with error feedback (on the senders, and on
  ``two_phase``'s owners) and every rank receives the same average ``m`` — linear in the
  gradient, so error feedback is exact again;
* the optimizer applies ``x -= lr * (m / (1 - beta1^t)) / (sqrt(v_frozen / (1 - beta2^t0)) + eps)``
  (``t0`` the step the variance froze at), with AdamW's decoupled weight decay first, and
  keeps ``m`` as its ``exp_avg``.

When the variance has settled is detected, not guessed: after every dense Adam step the
relative change of the bias-corrected variance's total over every rank (FSDP: over all shards),
``|S_t - S_(t-1)| / S_t``, is the same number on every rank, and the variance freezes once it stayed below ``freeze_tol``
for ``patience`` steps (from ``min_steps`` on; at ``max_steps`` at the latest) — or at a fixed step given as
``freeze``. The decision is the same on every rank, so every rank switches at the same step.
"""

from __future__ import annotations

import logging
import math

import torch

from ..transport.waits import wait
from .notices import notice

__all__ = ["FrozenVarianceAdam", "adam_family", "momentum_space", "FREEZE_TOL"]

logger = logging.getLogger(__name__)

#: the variance freezes once its bias-corrected total changes by less than this per step
FREEZE_TOL = 0.02


def adam_family(optimizer) -> bool:
    """Whether ``optimizer`` is ``torch.optim.Adam`` or ``AdamW`` (the momentum-space scheme)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def momentum_space(compressor, error_feedback: bool) -> bool:
    """Whether ``compressor`` goes to momentum space under Adam: the biased ones that keep
    error-feedback residuals (top-k, random-k, sign). Unbiased and near-lossless ones (QSGD,
    identity, fp16/bf16) and PowerSGD (its momentum stays with the optimizer) keep the
    gradient path, where Adam already keeps its quality."""
    return bool(error_feedback and getattr(compressor, "momentum_correction", True)
                and compressor.name not in ("identity", "fp16", "bf16"))


def _check_groups(optimizer) -> tuple[float, float]:
    """``(beta1, beta2)`` shared by every param group, or a ValueError naming what the
    frozen-variance update cannot do."""
    betas = {tuple(g["betas"]) for g in optimizer.param_groups}
    if len(betas) != 1:
        raise ValueError(f"momentum-space compression needs one (beta1, beta2) for every param "
                         f"group, got {sorted(betas)}")
    decoupled = isinstance(optimizer, torch.optim.AdamW) or any(
        g.get("decoupled_weight_decay", False) for g in optimizer.param_groups)
    for i, g in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize"):
            if g.get(key, False):
                raise ValueError(f"param group {i} has {key}=True; the frozen-variance update "
                                 "implements Adam and AdamW without it")
        if g.get("weight_decay", 0.0) and not decoupled:
            raise ValueError(f"param group {i} has Adam's L2 weight_decay={g['weight_decay']!r}; "
                             "in momentum space it would be compressed with the gradient: use "
                             "AdamW (decoupled weight decay)")
        if isinstance(g["lr"], torch.Tensor):
            raise ValueError(f"param group {i} has a tensor lr; pass a float")
    return next(iter(betas))


def _int_or_auto(name: str, v, low: int):
    if v == "auto":
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be 'auto' or an int >= {low}, got {v!r}")
    return v


class FrozenVarianceAdam:
    """The Adam side of momentum-space compression (see the module docstring).

    Args:
        optimizer: a ``torch.optim.Adam`` / ``AdamW``; its step is taken over once the
            variance freezes (a step pre-hook applies the frozen-variance update and clears
            the gradients, so Adam's own step has nothing left to do).
        mode: ``"shared"`` (1-bit Adam: each rank compresses ``beta1 m + (1 - beta1) g_i``
            from the shared momentum) or ``"local"`` (a velocity per rank: sparsifiers); see
            :meth:`momentum_`.
        freeze: ``"auto"`` (detected) or the step from which the momentum is compressed.
        min_steps / max_steps: the detection's earliest and latest freeze.
        freeze_tol: the relative change of the variance's total below which it freezes.

    Raises:
        ValueError: an optimizer layout the update cannot follow (several betas, amsgrad,
            maximize, Adam's L2 weight decay, a tensor lr), naming it.

    Example::

        >>> state = comms.register(ddp, "sign", optimizer=torch.optim.AdamW(ddp.parameters()))
        >>> state.adam.frozen, state.adam.freeze_iter   # after the variance settled
        (True, 37)
    """

    def __init__(self, optimizer, *, mode: str = "shared", freeze="auto", min_steps: int = 10,
                 max_steps: int = 400, freeze_tol: float = FREEZE_TOL, patience: int = 5):
        if not adam_family(optimizer):
            raise TypeError(f"optimizer must be torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
        self.beta1, self.beta2 = _check_groups(optimizer)
        self.freeze = _int_or_auto("adam_freeze", freeze, 1)
        if not (0.0 < float(freeze_tol) < 1.0):
            raise ValueError(f"freeze_tol must be in (0, 1), got {freeze_tol!r}")
        self.min_steps, self.max_steps, self.freeze_tol = int(min_steps), int(max_steps), float(freeze_tol)
        self.patience = int(patience)
        if mode not in ("shared", "local"):
            raise ValueError(f"mode must be 'shared' or 'local', got {mode!r}")
        self.mode = mode
        self.optimizer = optimizer
        self.frozen, self.freeze_iter, self.t_freeze = False, None, None
        self.prev_total: float | None = None
        self.changes: list[float] = []   # the agreed relative change after each dense step
        self.comm_fn = None              # the hook state's communicator, for the agreement
        self.iter_fn = None              # the hook state's step counter
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]

    # -- the hook side ------------------------------------------------------------------
    def active(self, step: int) -> bool:
        """Whether hook step ``step`` sends momentum (the variance froze before it)."""
        return self.frozen and step >= self.freeze_iter

    def start(self, step: int, start_iter: int) -> int:
        """The first compressed step as the planner should see it at hook step ``step``:
        never before the variance froze."""
        if self.frozen:
            return max(start_iter, self.freeze_iter)
        return max(start_iter, step + 1)

    def shared_momentum(self, params) -> torch.Tensor:
        """The optimizer's ``exp_avg`` of ``params`` (a bucket's, in order), flat: the shared
        momentum every rank holds with the same bits."""
        parts = []
        for p in params:
            m = self.optimizer.state.get(p, {}).get("exp_avg")
            parts.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if m is None
                         else m.reshape(-1))
        return torch.cat(parts) if parts else torch.zeros(0)

    def momentum_(self, memory, index: int, x: torch.Tensor, mbar: torch.Tensor, div: int,
                  world: int) -> torch.Tensor:
        """This rank's share of the momentum that travels, in place (``x`` its gradient,
        divided by ``div`` unless already; ``world`` the ranks whose shares add up; ``mbar`` the
        shared momentum). Private arithmetic.

        * ``"shared"`` (sign; 1-bit Adam): ``x <- (1 - beta1) x / div + beta1 mbar / world`` —
          every rank restarts from the shared momentum each step.
        * ``"local"`` (sparsifiers): DGC's momentum correction with Adam's beta1: a velocity
          per rank and bucket, ``u <- beta1 u + x / div``, started from ``mbar / ((1 - beta1)
          world)``; ``x <- u``. A sparsifier leaves most coordinates out of each aggregate; the
          shared scheme would restart their momentum from 0 every step.
        """
        if self.mode == "shared":
            if div != 1:
                x.div_(div)
            return x.mul_(1.0 - self.beta1).add_(mbar.to(x.dtype), alpha=self.beta1 / world)
        if memory.velocity(index, x) is None:
            memory.velocities[index] = torch.zeros_like(x) if mbar.numel() != x.numel() else \
                mbar.to(x.dtype).div((1.0 - self.beta1) * world)
        return memory.momentum_(index, x, self.beta1, div)

    def masking(self, step: int) -> str | None:
        """The momentum-masking rule at hook step ``step``: ``"sent"`` (DGC's) for the local
        velocity — without it a sparsifier's unsent coordinates keep re-adding their momentum
        to the residual and the frozen-variance step blows up (the 12.7M char transformer's
        top-k 1% loss rose from 2.30 to 3.25 thirty steps after the freeze; 1.004x dense's final
        loss with it) — else ``None`` (the pipeline's own rule)."""
        return "sent" if self.mode == "local" and self.active(step) else None

    # -- the optimizer side -------------------------------------------------------------
    def _pre_step(self, opt, args, kwargs):
        if not self.frozen:
            return None
        # ``args`` is (optimizer, *positional arguments of step)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is not None:  # Lightning and friends run backward inside step(): run it first
            with torch.enable_grad():
                loss = closure()
            args, kwargs = args[:1], {**kwargs, "closure": lambda: loss}
        with torch.no_grad():
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._frozen_update(p, group)
                        p.grad = None  # applied: Adam's own step skips it
        return (args, kwargs) if closure is not None else None

    def _frozen_update(self, p: torch.Tensor, group: dict) -> None:
        """``p`` from the averaged momentum in ``p.grad`` and the frozen variance; elementwise
        IEEE operations only (the same bits on every rank: ARCHITECTURE.md §5)."""
        st = self.optimizer.state[p]
        st["step"] += 1
        t = float(st["step"])
        lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        m = st["exp_avg"]
        if self.mode == "shared":
            m.copy_(p.grad)
        else:  # the aggregate of the undampened velocities: Adam's momentum is (1 - beta1) of it
            torch.mul(p.grad, 1.0 - self.beta1, out=m)
        if wd:
            p.mul_(1.0 - lr * wd)
        denom = st["exp_avg_sq"].div(1.0 - self.beta2 ** self.t_freeze).sqrt_().add_(eps)
        p.sub_(m.div(denom).mul_(lr / (1.0 - self.beta1 ** t)))

    def _variance_total(self) -> float:
        total, t = 0.0, None
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                if st and "exp_avg_sq" in st:
                    v = st["exp_avg_sq"]
                    v = v.to_local() if hasattr(v, "to_local") else v  # FSDP2: this rank's shard
                    total += float(v.sum(dtype=torch.float64))
                    t = float(st["step"])
        return total / (1.0 - self.beta2 ** t) if t else 0.0

    def _post_step(self, opt, args, kwargs):
        """After a dense Adam step: measure the variance's change, agree, maybe freeze."""
        if self.frozen or self.comm_fn is None:
            return None
        comm, it = self.comm_fn(), self.iter_fn()
        total = self._variance_total()
        if comm.world_size > 1:  # every rank's total (FSDP: its shards'), summed in rank order
            t = torch.tensor([total], dtype=torch.float64)
            what = f"commpress: variance-freeze agreement at step {it} on rank {comm.rank}"
            total = float(sum(wait(comm.all_gather(t), comm.timeout, what).tolist()))
        change = 1.0 if not self.prev_total or total <= 0 else abs(total - self.prev_total) / total
        self.prev_total = total
        self.changes.append(change)
        fixed = self.freeze != "auto"
        settled = len(self.changes) >= self.patience and max(self.changes[-self.patience:]) < self.freeze_tol
        if (fixed and it >= self.freeze) or (not fixed and (
                (it >= self.min_steps and settled) or it >= self.max_steps)):
            self._freeze(it)
        return None

    def _freeze(self, it: int) -> None:
        steps = {float(st["step"]) for st in self.optimizer.state.values() if "step" in st}
        self.frozen, self.freeze_iter = True, it
        self.t_freeze = max(steps) if steps else 1.0
        notice(logger, "commpress: Adam's variance frozen after %d dense steps (relative change "
               "%.4f); the momentum is compressed from step %d", it, self.changes[-1] if
               self.changes else math.nan, it, rank=self.comm_fn().rank if self.comm_fn else None)

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"frozen": self.frozen, "freeze_iter": self.freeze_iter, "t_freeze": self.t_freeze,
                "prev_total": self.prev_total, "changes": list(self.changes)}

    def load_state_dict(self, sd: dict) -> None:
        self.frozen = bool(sd["frozen"])
        self.freeze_iter, self.t_freeze = sd["freeze_iter"], sd["t_freeze"]
        self.prev_total, self.changes = sd["prev_total"], list(sd["changes"])

    def remove(self) -> None:
        """Detach from the optimizer (its step is Adam's own again)."""
        for h in self._handles:
            h.remove()
