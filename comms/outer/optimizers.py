"""Outer optimizers: how a fragment's averaged pseudo-gradient moves the synced parameters.

Every rank holds the same synced parameters (``anchor``), the same averaged pseudo-gradient
``d`` (the engine's aggregate) and the same outer state, and applies the same elementwise
operations in the same order (ARCHITECTURE.md §5: no fused multiply-add, no reductions), so the
new synced parameters have the same bits on every rank.

* ``"nesterov"`` (DiLoCo's outer optimizer): ``m <- mu m + d``; ``anchor <- anchor - lr (d + mu m)``;
  defaults ``lr`` 1.0, ``mu`` 0.5 — DiLoCo's 0.7 and 0.9 were chosen for ``H`` = 500; at the
  ``H`` of 4-64 that hide a slow link's transfer they overshoot (docs/design-notes.md, "Outer
  sync").
* ``"average"`` (the default): ``anchor <- anchor - d``: the average of the replicas' parameters
  (post-local SGD's model averaging); no state. At ``H`` 4 it reached dense's loss in 1.0-1.3x
  dense's steps under SGD and AdamW, where ``"nesterov"`` needed 2x or diverged.
* ``"sparseloco"`` (SparseLoCo): ``anchor <- anchor - lr d`` with ``lr`` 1; error feedback on the
  compressed pseudo-gradient in place of outer momentum (it needs a compressor that keeps one).
"""

from __future__ import annotations

import torch

__all__ = ["OUTER_OPTIMIZERS", "OuterOptimizer", "check_outer", "default_outer", "is_adaptive"]

#: name -> (default lr, default momentum)
OUTER_OPTIMIZERS = {"nesterov": (1.0, 0.5), "average": (1.0, 0.0), "sparseloco": (1.0, 0.0)}


def is_adaptive(optimizer) -> bool:
    """Whether ``optimizer`` scales its steps per coordinate (Adam's family: ``betas`` in its
    parameter groups)."""
    return any("betas" in g for g in getattr(optimizer, "param_groups", ()))


def default_outer(outer_momentum=None) -> str:
    """The outer optimizer ``outer=None`` means: ``"nesterov"`` when ``outer_momentum`` is given,
    else ``"average"`` (docs/design-notes.md, "Outer sync")."""
    return "average" if outer_momentum is None else "nesterov"


class OuterOptimizer:
    """One outer optimizer (see the module docstring); ``state`` per fragment: the momentum."""

    def __init__(self, name: str, lr: float | None = None, momentum: float | None = None):
        self.name = name
        default_lr, default_mu = OUTER_OPTIMIZERS[name]
        self.lr = float(default_lr if lr is None else lr)
        self.momentum = float(default_mu if momentum is None else momentum)

    def step_(self, anchor: torch.Tensor, d: torch.Tensor, state: dict) -> torch.Tensor:
        """Move ``anchor`` (flat, in place) by the averaged pseudo-gradient ``d``; returns it."""
        if self.name == "nesterov" and self.momentum:
            m = state.get("momentum")
            if m is None:
                m = state["momentum"] = torch.zeros_like(d)
            m.mul_(self.momentum).add_(d)
            d = torch.mul(m, self.momentum).add_(d)
        if self.lr != 1.0:
            d = torch.mul(d, self.lr)
        return anchor.sub_(d)

    def plain(self) -> bool:
        """Whether :meth:`step_` is ``anchor <- anchor - d`` (no momentum, lr 1): the landing
        pass (:func:`comms.outer.passes.land_pass`) then takes the step itself."""
        return not (self.name == "nesterov" and self.momentum) and self.lr == 1.0

    def describe(self) -> str:
        return f"{self.name} lr {self.lr:g}" + (f" momentum {self.momentum:g}" if self.name == "nesterov" else "")


def check_outer(name, lr, momentum, compressor, error_feedback: bool) -> None:
    """Raise naming a bad outer optimizer setting, or one the compressor cannot serve."""
    if name not in OUTER_OPTIMIZERS:
        raise ValueError(f"outer must be one of {sorted(OUTER_OPTIMIZERS)}, got {name!r}")
    for key, v, low in (("outer_lr", lr, 0.0), ("outer_momentum", momentum, 0.0)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= low or v != v:
            raise ValueError(f"{key} must be a number >= {low:g}, got {v!r}")
    if momentum is not None and momentum >= 1:
        raise ValueError(f"outer_momentum must be < 1, got {momentum!r}")
    if momentum and name != "nesterov":
        raise ValueError(f"outer_momentum={momentum!r} applies to outer='nesterov'; outer={name!r} "
                         "keeps no momentum")
    if name == "sparseloco" and not error_feedback:
        raise ValueError(f"outer='sparseloco' replaces outer momentum by error feedback on the "
                         f"pseudo-gradient; {compressor.spec()!r} keeps none (pass error_feedback=True "
                         "or a biased compressor: topk, sign, randomk)")
