"""Momentum-space compression for Adam(W): 1-bit Adam's frozen variance behind ``register``.

Error feedback is exact for optimizers linear in the gradient; Adam divides by ``sqrt(v)``,
which is not, and compressed gradients under Adam lose quality. 1-bit Adam (Tang et al., ICML
2021) runs Adam with dense gradients while its variance ``v`` settles, then holds ``v`` fixed:
the step is linear in the momentum again and error feedback exact.

* **When** (:class:`~comms.core.adam_policy.VariancePolicy`): the variance freezes once its
  per-element relative change settled (clipping, schedules and loss scales cannot fool it)
  and is refreshed by a dense step at geometrically spaced steps afterwards.
* **What travels** (``mode``): ``"shared"`` (sign) — each rank's share of the new momentum
  from the shared momentum ``m`` every rank holds with the same bits, ``(beta1 - rho) m +
  (1 - beta1) g_i`` (1-bit Adam at ``rho = 0``, the default; the delivered aggregate ``A``
  makes the new momentum ``rho m + A``); ``"local"`` (sparsifiers) — a velocity per rank
  (DGC's momentum correction; DDP without masking, FSDP with DGC's). Where the variance is
  replicated (DDP: ``precondition``) both travel in Adam's preconditioned coordinates,
  multiplied by ``1 / (sqrt(vhat) + eps)``: the compressor ranks and scales elements by the
  step Adam would take, not by the raw gradient (whose scale differs by orders of magnitude
  between an embedding, a LayerNorm and a projection). Each rank's gradient is first
  multiplied by ``loop.scale`` (:class:`~comms.core.adam_share.LoopFactor`), the factor the
  training loop applied to the gradients at the last dense step (``clip_grad_norm_``, a loss
  scaler's unscale), so the momentum is built in the units the variance was.
* **What arrives** (DDP): a parameter in momentum space holds its new momentum (``exp_avg``'s
  units) in ``.grad`` after backward.
* **The step** (an optimizer step pre-hook): every parameter whose bucket went through the
  momentum space this step (:meth:`FrozenVarianceAdam.mark`) takes the frozen-variance step —
  a factor the loop applied to ``.grad`` meanwhile is divided out (it already was in
  ``loop.scale``); every other parameter with a gradient got the plain dense average and
  takes AdamW's own step: on a refresh step with the refresh's weight, otherwise
  ``torch.optim.AdamW``'s step itself after :func:`~comms.core.adam_steps.thaw_` (a bucket the auto
  planner sends dense, a warm-up step, a small bucket: exact AdamW from then on, from a state
  of AdamW's own).

Every decision is the same on every rank; every operation after a collective is elementwise
(ARCHITECTURE.md §5).
"""

from __future__ import annotations

import logging

import torch

from ..transport.waits import wait
from .adam_policy import FREEZE_TOL, REFRESH_RATIO, VariancePolicy
from .adam_share import EMPTY, LoopFactor, Preconditioner, Share
from .adam_steps import frozen_step_, refresh_step_, thaw_, variance_change
from ..transport.notices import notice

__all__ = ["FrozenVarianceAdam", "Share", "adam_family", "momentum_space", "FREEZE_TOL",
           "REFRESH_RATIO", "MODES"]

logger = logging.getLogger(__name__)

MODES = ("shared", "local")


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


def _params(optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def check_groups(optimizer) -> tuple[float, float]:
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


class FrozenVarianceAdam:
    """The Adam side of momentum-space compression (see the module docstring).

    Args:
        optimizer: a ``torch.optim.Adam`` / ``AdamW``; a step pre-hook applies the
            frozen-variance and refresh steps and clears those gradients, so Adam's own step
            sees only the parameters it should step itself.
        mode: ``"shared"`` or ``"local"``.
        precondition: travel in Adam's preconditioned coordinates (DDP: the variance is
            replicated on every rank); implies ``delivers``.
        delivers: the adapter hands every momentum-space aggregate to its share's
            :meth:`~comms.core.adam_share.Share.deliver_`, so ``.grad`` holds the new momentum (DDP).
        rho: ``"shared"``: how much of the shared momentum the new one keeps where the
            aggregate leaves an element out (0: 1-bit Adam's).
        velocity_masking: ``"local"``: ``"sent"`` (DGC's: a velocity is zeroed where it was
            sent) or ``"off"`` (the velocities stay the momentum filter of every gradient).
        freeze, min_steps, max_steps, freeze_tol, patience, refresh_ratio: the
            :class:`~comms.core.adam_policy.VariancePolicy`.

    Raises:
        TypeError: not an Adam/AdamW.
        ValueError: an optimizer layout the update cannot follow (several betas, amsgrad,
            maximize, Adam's L2 weight decay, a tensor lr) or a bad option, naming it.

    Example::

        >>> state = comms.register(ddp, "sign", optimizer=torch.optim.AdamW(ddp.parameters()))
        >>> state.adam.frozen, state.adam.freeze_iter   # after the variance settled
        (True, 37)
    """

    def __init__(self, optimizer, *, mode: str = "shared", precondition: bool = False,
                 delivers: bool = False, rho: float = 0.0, velocity_masking: str = "sent", freeze="auto", min_steps: int = 10, max_steps: int = 400,
                 freeze_tol: float = FREEZE_TOL, patience: int = 5,
                 refresh_ratio: float = REFRESH_RATIO):
        if not adam_family(optimizer):
            raise TypeError(f"optimizer must be torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
        self.beta1, self.beta2 = check_groups(optimizer)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.policy = VariancePolicy(freeze, min_steps=min_steps, max_steps=max_steps,
                                     freeze_tol=freeze_tol, patience=patience,
                                     refresh_ratio=refresh_ratio)
        self.mode, self.precondition, self.rho = mode, bool(precondition), float(rho)
        self.delivers = bool(delivers or precondition)
        if velocity_masking not in ("sent", "off"):
            raise ValueError(f"velocity_masking must be 'sent' or 'off', got {velocity_masking!r}")
        self.velocity_masking = velocity_masking
        self.optimizer = optimizer
        self.vstep: dict = {}            # param -> the step its variance was last updated at
        self.loop = LoopFactor()         # the loop's factor on .grad (``loop.scale``)
        self.preconditioner = Preconditioner(optimizer, self.beta2, self.vstep.get)
        self.comm_fn = None              # the hook state's communicator, for the agreement
        self.iter_fn = None              # the hook state's step counter
        self.modules: list = []          # FSDP: the modules, by the state's module index
        self._module_params: dict[int, list] = {}
        self._marked: tuple[int, set] = (-1, set())
        self._change: tuple[float, float] | None = None
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]

    # -- what the policy decided ---------------------------------------------------------
    @property
    def frozen(self) -> bool:
        return self.policy.frozen

    @property
    def freeze_iter(self) -> int | None:
        return self.policy.freeze_iter

    def active(self, step: int) -> bool:
        """Whether hook step ``step`` sends momentum (frozen before it, not a refresh)."""
        return self.frozen and step >= self.freeze_iter and not self.policy.refreshing(step)

    def start(self, step: int, start_iter: int) -> int:
        """The first compressed step as the planner should see it at hook step ``step``:
        never before the variance froze; past ``step`` on a refresh step (dense, untimed)."""
        if self.active(step):
            return max(start_iter, self.freeze_iter)
        return max(start_iter, step + 1)

    # -- the hook side ------------------------------------------------------------------
    def mark(self, params, step: int) -> None:
        """``params`` go through the momentum space at hook step ``step``: the optimizer gives
        them the frozen-variance step. An int: FSDP module ``params`` of :attr:`modules` (its
        sharded parameters)."""
        if isinstance(params, int):
            index = params
            params = self._module_params.get(index)
            if params is None:
                params = self._module_params[index] = [
                    fp.sharded_param for g in self.modules[index]._get_fsdp_state()._fsdp_param_groups
                    for fp in g.fsdp_params]
        if self._marked[0] != step:
            self._marked = (step, set())
        self._marked[1].update(params)

    def share(self, params, momentum: bool = True) -> Share:
        """The :class:`~comms.core.adam_share.Share` of ``params`` (a bucket's, in order); without
        ``momentum`` the momentum is left out (:data:`~comms.core.adam_share.EMPTY`)."""
        pre = self.preconditioner(params) if self.precondition else None
        coef = (self.mode, self.beta1, self.rho)
        if not momentum:
            return Share(EMPTY, pre, *coef)
        parts = []
        for p in params:
            m = self.optimizer.state.get(p, {}).get("exp_avg")
            parts.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device) if m is None
                         else m.reshape(-1))
        mbar = torch.cat(parts) if parts else EMPTY
        return Share(mbar if pre is None else mbar.mul_(pre), pre, *coef)

    def momentum_(self, memory, index: int, x: torch.Tensor, share, div: int,
                  world: int) -> torch.Tensor:
        """This rank's share of what travels, in place (``x`` its gradient, divided by ``div``
        unless already; ``world`` the ranks whose shares add up; ``share`` a :class:`Share` —
        or, from FSDP, the shared momentum alone, a tensor, empty where not read). Private
        arithmetic. With ``mbar`` the shared momentum, ``pre`` the preconditioner (1 without)
        and ``c`` the loop's factor at the last dense step (``loop.scale``), ``y = c pre x / div``:

        * ``"shared"``: ``x <- (1 - beta1) y + (beta1 - rho) mbar / world``.
        * ``"local"``: a velocity per rank and bucket, ``u <- beta1 u + y``, started from
          ``mbar / ((1 - beta1) world)``; ``x <- u``.
        """
        mbar, pre = (share.momentum, share.pre) if isinstance(share, Share) else (share, None)
        if div != 1:
            x.div_(div)
        if pre is not None:
            x.mul_(pre)
        x.mul_(self.loop.scale.to(x.device, x.dtype))
        if self.mode == "shared":
            return x.mul_(1.0 - self.beta1).add_(mbar.to(x.dtype), alpha=(self.beta1 - self.rho) / world)
        if memory.velocity(index, x) is None:
            memory.velocities[index] = torch.zeros_like(x) if mbar.numel() != x.numel() else \
                mbar.to(x.dtype).div((1.0 - self.beta1) * world)
        return memory.momentum_(index, x, self.beta1, 1)

    def masking(self, step: int) -> str | None:
        """The momentum-masking rule of the local velocity at hook step ``step`` (``None``: the
        pipeline's own rule, for ``"shared"``): :attr:`velocity_masking`."""
        return self.velocity_masking if self.mode == "local" and self.active(step) else None

    # -- the optimizer side -------------------------------------------------------------
    def _pre_step(self, opt, args, kwargs):
        # ``args`` is (optimizer, *positional arguments of step)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is not None:  # Lightning and friends run backward inside step(): run it first
            with torch.enable_grad():
                loss = closure()
            args, kwargs = args[:1], {**kwargs, "closure": lambda: loss}
        step = self.iter_fn() - 1 if self.iter_fn is not None else -1
        with torch.no_grad():
            if not self.active(step):  # a dense step: the loop's factor on true gradients
                factor = self.loop.seen(step, self.loop.scale)
                if factor is not None:
                    self.loop.scale = factor.to(torch.float32)  # stays on its device: no sync
                factor = None
            else:  # the factor on delivered momenta: divided out (it is in the scale)
                factor = self.loop.seen(step, torch.ones(()))
            if not self.frozen:
                self._change = variance_change(self.optimizer, self.beta2)
                self.preconditioner.changed()
            else:
                self._frozen_steps(opt, step, factor)
        return (args, kwargs) if closure is not None else None

    def _frozen_steps(self, opt, step: int, factor) -> None:
        marked = self._marked[1] if self._marked[0] == step else set()
        refresh = self.policy.refreshing(step)
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.optimizer.state[p]
                if p in marked:
                    s = self.vstep.setdefault(p, float(st["step"]))
                    m = p.grad if self.delivers or self.mode == "shared" else p.grad.mul(1.0 - self.beta1)
                    if factor is not None:
                        m = m.div(factor)
                    frozen_step_(p, st, group, m, s, self.beta1, self.beta2)
                    p.grad = None  # applied: Adam's own step skips it
                    continue
                self.preconditioner.changed(p)  # its variance changes
                if refresh and p in self.vstep:
                    refresh_step_(p, st, group, p.grad, self.vstep.pop(p), self.beta1, self.beta2)
                    p.grad = None
                elif p in self.vstep:
                    thaw_(st, self.vstep.pop(p), self.beta2)  # then AdamW's own step

    def _post_step(self, opt, args, kwargs):
        """After the step: the freeze agreement (before it), the refresh bookkeeping (after)."""
        if self.iter_fn is None:
            return None
        it = self.iter_fn()
        if self.frozen:
            self.policy.refreshed(it - 1)
            return None
        if self.comm_fn is None:
            return None
        change, total = self._change if self._change is not None else (1.0, 1.0)
        self._change = None
        comm = self.comm_fn()
        if comm.world_size > 1:  # every rank's sums (FSDP: its shards'), added in rank order
            t = torch.tensor([change, total], dtype=torch.float64)
            what = f"commpress: variance-freeze agreement at step {it} on rank {comm.rank}"
            rows = wait(comm.all_gather(t), comm.timeout, what).reshape(-1, 2).tolist()
            change, total = sum(r[0] for r in rows), sum(r[1] for r in rows)
        rel = 1.0 if total <= 0 else change / total
        if self.policy.observe(it, rel):
            notice(logger, "commpress: Adam's variance frozen after %d dense steps (per-element "
                   "relative change %.4f); the momentum is compressed from step %d", it, rel, it,
                   rank=comm.rank)
        return None

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict:
        index = {p: i for i, p in enumerate(_params(self.optimizer))}
        return {**self.policy.state_dict(), "scale": float(self.loop.scale),
                "vstep": {int(index[p]): float(s) for p, s in self.vstep.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self.policy.load_state_dict(sd)
        params = _params(self.optimizer)
        self.vstep.clear()
        self.vstep.update({params[int(i)]: float(s) for i, s in sd.get("vstep", {}).items()})
        self.loop.scale = torch.tensor(float(sd.get("scale", 1.0)))
        self.preconditioner.changed()

    def remove(self) -> None:
        """Detach from the optimizer (its step is Adam's own again)."""
        for h in self._handles:
            h.remove()
