"""``CommpressStatsCallback``: commpress' numbers in Lightning's logger.

Every ``logging_interval`` training steps, rank 0 logs with ``self.log`` (so to whatever logger
the Trainer has: CSV, TensorBoard, W&B, ...):

* ``commpress/wire_bytes``: bytes one rank sent in the last step; ``commpress/dense_bytes``:
  what a dense allreduce would have sent; ``commpress/ratio``: dense / wire;
* with ``algorithm="auto"``: ``commpress/tuning_steps`` (steps the last tuning took),
  ``commpress/locked`` (1 once a plan is locked) and ``commpress/plan_compressed`` (1 when the
  locked plan compresses, 0 when it is dense).

When the autotuner locks a plan, rank 0 logs one INFO line (what was locked, after how many
tuning steps, at what cost) and records the plan as the hyperparameter ``commpress_plan``
(strings cannot go through ``self.log``). Works with
:class:`~comms.integrations.lightning.CommpressDDPStrategy` (its ``commpress_state``); with
any other strategy it logs nothing.

Example::

    >>> from comms.integrations.callback import CommpressStatsCallback
    >>> trainer = L.Trainer(strategy=CommpressDDPStrategy("qsgd:bits=4"), devices=2,
    ...                     accelerator="cpu", callbacks=[CommpressStatsCallback()])
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import Callback

from .pairing import summary

__all__ = ["CommpressStatsCallback"]

logger = logging.getLogger(__name__)


class CommpressStatsCallback(Callback):
    """Log wire bytes, compression ratio and the autotune plan on rank 0.

    Args:
        logging_interval: log every this many training steps (>= 1).
        prefix: metric name prefix.

    Raises:
        ValueError: ``logging_interval`` is not an int >= 1.
    """

    def __init__(self, logging_interval: int = 1, prefix: str = "commpress/"):
        if isinstance(logging_interval, bool) or not isinstance(logging_interval, int) \
                or logging_interval < 1:
            raise ValueError(f"logging_interval must be an int >= 1, got {logging_interval!r}")
        self.logging_interval, self.prefix = logging_interval, prefix
        self.locked_plan: str | None = None  # the last plan seen locked (rank 0)

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        state = getattr(trainer.strategy, "commpress_state", None)
        if state is None or not trainer.is_global_zero:
            return
        s = summary(state)
        if s.get("locked") and s["plan"] != self.locked_plan:
            self._on_lock(trainer, s)
        if trainer.global_step % self.logging_interval:
            return
        p = self.prefix
        metrics = {p + "wire_bytes": float(s["wire_bytes"]), p + "dense_bytes": float(s["dense_bytes"]),
                   p + "ratio": s["ratio"]}
        if "locked" in s:
            metrics.update({p + "tuning_steps": float(s["tuning_steps"]),
                            p + "locked": float(s["locked"]),
                            p + "plan_compressed": float(bool(s["plan"]) and s["plan"] != "dense")})
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True,
                           batch_size=1, prog_bar=False, logger=True)

    def _on_lock(self, trainer, s: dict) -> None:
        self.locked_plan = s["plan"]
        logger.info("commpress: autotune locked %r after %d tuning steps (%.0f ms beyond the "
                    "locked plan; tuning %d): it was the fastest measured plan, dense when no "
                    "compressed plan won", s["plan"], s["tuning_steps"], s["tuning_cost_s"] * 1e3,
                    s["tunings"])
        if trainer.logger is not None:
            trainer.logger.log_hyperparams({"commpress_plan": str(s["plan"]),
                                            "commpress_tuning_steps": s["tuning_steps"]})
