"""When Adam's variance freezes and when it is refreshed: :class:`VariancePolicy`.

The momentum-space scheme (:mod:`comms.core.adam`) needs Adam's variance ``v`` fixed while the
momentum is compressed, and ``v`` close to what dense Adam would hold. Two decisions:

**The freeze.** After every dense Adam step the per-element relative change of the
bias-corrected variance, ``D_t = sum_i |vhat_t[i] - vhat_(t-1)[i]| / sum_i vhat_t[i]``, summed over
every element of every rank (FSDP: over all shards) and the same number on every rank. The
variance freezes once ``D_t`` stayed below ``freeze_tol`` for ``patience`` steps (from
``min_steps`` on, at ``max_steps`` at the latest) — or at a fixed step. ``D_t`` measures how
much one more gradient still moves the individual estimates (about ``E|g^2/vhat - 1| / t``
early on), so it is blind to everything that rescales the whole gradient: clipping to a norm
(which pins the *total* of ``v``: a test on the total fires at once), a learning-rate warm-up
or decay (``v`` does not see the learning rate), a loss scale (Adam sees unscaled gradients).

**The refreshes.** Dense Adam's ``vhat_t`` is the average of ``g^2`` over the ``t`` steps so
far (for ``t << 1 / (1 - beta2)``); frozen at ``t0`` it keeps the early gradients' weight for
good, while dense Adam's keeps diluting them (measured on the char transformer: the frozen
``sqrt(vhat)`` at step 50 was 1.8x dense's at step 300, elementwise on average — a 1.8x smaller
step). So the variance is refreshed at geometrically spaced steps after the freeze, each
``refresh_ratio`` later than the last (0/1 Adam's policy: variance updates at exponentially
growing intervals; Lu et al., 2022): the refresh step goes dense and its ``g^2`` stands for
every step since the last update (:meth:`comms.core.adam.FrozenVarianceAdam` weighs it ``k`` steps
of the EMA), so ``vhat`` follows dense Adam's at ``O(log T)`` dense steps in ``T``.

Everything here is host arithmetic on numbers every rank agreed on: every rank decides alike.
"""

from __future__ import annotations

import math

__all__ = ["VariancePolicy", "check_freeze", "FREEZE_TOL", "REFRESH_RATIO"]

#: the variance freezes once its per-element relative change stays below this per step
FREEZE_TOL = 0.02

#: a refresh comes this share of the steps so far after the last one (0: never refresh)
REFRESH_RATIO = 0.25


def check_freeze(adam_freeze):
    """``adam_freeze`` as given: ``"auto"``, an int >= 1 or ``None``; a ValueError naming a
    bad value otherwise."""
    if adam_freeze is None or (isinstance(adam_freeze, str) and adam_freeze == "auto"):
        return adam_freeze
    if isinstance(adam_freeze, bool) or not isinstance(adam_freeze, int) or adam_freeze < 1:
        raise ValueError(f"adam_freeze must be 'auto', an int >= 1 (the step the variance "
                         f"freezes at) or None (the gradient path), got {adam_freeze!r}")
    return adam_freeze


class VariancePolicy:
    """The freeze decision and the refresh schedule (see the module docstring), in hook steps.

    Args:
        freeze: ``"auto"`` (detected) or the hook step from which the momentum is compressed.
        min_steps / max_steps: the detection's earliest and latest freeze.
        freeze_tol: the per-element relative change below which the variance has settled.
        patience: how many consecutive dense steps it must stay below.
        refresh_ratio: the gap to the next refresh as a share of the steps so far (0: the
            variance stays frozen).

    Raises:
        ValueError: a bad value, naming it.
    """

    def __init__(self, freeze="auto", *, min_steps: int = 10, max_steps: int = 400,
                 freeze_tol: float = FREEZE_TOL, patience: int = 5,
                 refresh_ratio: float = REFRESH_RATIO):
        if freeze is None:
            raise ValueError("adam_freeze must be 'auto' or an int >= 1 here (None: no policy)")
        self.freeze = check_freeze(freeze)
        if not (0.0 < float(freeze_tol) < 1.0):
            raise ValueError(f"freeze_tol must be in (0, 1), got {freeze_tol!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        if not (0.0 <= float(refresh_ratio) < float("inf")):
            raise ValueError(f"refresh_ratio must be a number >= 0, got {refresh_ratio!r}")
        self.min_steps, self.max_steps = int(min_steps), int(max_steps)
        self.freeze_tol, self.patience = float(freeze_tol), patience
        self.refresh_ratio = float(refresh_ratio)
        self.freeze_iter: int | None = None   # the first hook step that compresses
        self.next_refresh: int | None = None  # the next hook step that goes dense to refresh
        self.refreshes = 0
        self.changes: list[float] = []        # the agreed D_t after each dense step before it

    @property
    def frozen(self) -> bool:
        return self.freeze_iter is not None

    def observe(self, it: int, change: float) -> bool:
        """After the dense Adam step that ends hook step ``it - 1`` (``change``: its agreed
        ``D_t``): whether the variance freezes now, compressing from hook step ``it``."""
        self.changes.append(float(change))
        if self.frozen:
            return False
        if self.freeze != "auto":
            settled = it >= self.freeze
        else:
            recent = self.changes[-self.patience:]
            settled = (it >= self.min_steps and len(recent) == self.patience
                       and max(recent) < self.freeze_tol) or it >= self.max_steps
        if settled:
            self.freeze_iter = it
            self.next_refresh = self._after(it)
        return settled

    def refreshing(self, step: int) -> bool:
        """Whether hook step ``step`` goes dense to refresh the variance."""
        return self.next_refresh is not None and step == self.next_refresh

    def refreshed(self, step: int) -> None:
        """The refresh of hook step ``step`` was applied: schedule the next one."""
        if self.refreshing(step):
            self.refreshes += 1
            self.next_refresh = self._after(step + 1)

    def _after(self, it: int) -> int | None:
        if self.refresh_ratio <= 0:
            return None
        return it + max(1, math.ceil(self.refresh_ratio * it))

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"freeze_iter": self.freeze_iter, "next_refresh": self.next_refresh,
                "refreshes": self.refreshes, "changes": list(self.changes)}

    def load_state_dict(self, sd: dict) -> None:
        self.freeze_iter, self.next_refresh = sd["freeze_iter"], sd["next_refresh"]
        self.refreshes, self.changes = int(sd["refreshes"]), list(sd["changes"])
