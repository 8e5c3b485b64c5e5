"""Lightning: ``CommpressDDPStrategy``, a ``DDPStrategy`` that compresses gradients.

Lightning's own ``DDPStrategy(ddp_comm_state=, ddp_comm_hook=)`` registers a hook only when
the device is CUDA (on CPU it silently registers nothing). This strategy registers the
commpress hook (:func:`comms.register`) on the wrapped ``DistributedDataParallel`` on any
device, and keeps every rank's state (residuals, step counter, layouts) in the Lightning
checkpoint under ``"commpress"`` (gathered at save through
:class:`~comms.integrations.rank_states.RankStates`, each rank's own entry restored at
load, whether Lightning restores before or after the strategy's setup).

Fabric has no hook argument; register on the DDP module that ``fabric.setup`` wraps::

    model = fabric.setup(model)
    state = comms.register(model._forward_module, "topk:density=0.01")

Example::

    >>> from comms.integrations.lightning import CommpressDDPStrategy
    >>> strategy = CommpressDDPStrategy("topk:density=0.01", start_iter=2)
    >>> trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2)
    >>> trainer.fit(model)
    >>> print(strategy.commpress_state.report())
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from lightning.pytorch.strategies import DDPStrategy

from compressors import from_spec

from ..register import register
from .rank_states import RankStates

__all__ = ["CommpressDDPStrategy", "CHECKPOINT_KEY"]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "commpress"

_REGISTER_KEYS = ("check_replicas_every", "error_feedback", "start_iter", "algorithm", "seed",
                  "min_compress_numel", "autotune", "autotune_steps", "warmup_steps")


class CommpressDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with the commpress hook on CPU and GPU.

    Args:
        compressor: a :class:`compressors.Compressor` or a spec string.
        **kwargs: options of :func:`comms.register` (``algorithm``, ``error_feedback``,
            ``start_iter``, ``seed``, ``min_compress_numel``, ``check_replicas_every``,
            ``autotune``, ``autotune_steps``, ``warmup_steps``); everything else goes to
            ``DDPStrategy``
            (``ddp_comm_hook`` / ``ddp_comm_state`` / ``ddp_comm_wrapper`` are refused: DDP
            takes one hook).

    Raises:
        ValueError: a bad compressor spec or a DDP hook argument (at construction).
    """

    def __init__(self, compressor, **kwargs: Any):
        for k in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if kwargs.get(k) is not None:
                raise ValueError(f"CommpressDDPStrategy registers its own DDP hook; {k} is not allowed")
        self.commpress_compressor = from_spec(compressor)  # validated here, not at fit time
        self.commpress_kwargs = {k: kwargs.pop(k) for k in _REGISTER_KEYS if k in kwargs}
        super().__init__(**kwargs)
        self.commpress_state = None
        self._commpress_pending: dict | None = None

    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers hooks on CUDA only; ours goes on any device
        self.commpress_state = register(self.model, self.commpress_compressor, **self.commpress_kwargs)
        if self._commpress_pending is not None:  # Lightning restored the checkpoint before setup
            RankStates(self.commpress_state).load_state_dict(self._commpress_pending)
            self._commpress_pending = None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        # every rank is here (Trainer.save_checkpoint is collective): gather, rank 0 writes
        if self.commpress_state is not None:
            checkpoint[CHECKPOINT_KEY] = RankStates(self.commpress_state).state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        sd = checkpoint.get(CHECKPOINT_KEY)
        if sd is None:
            return
        if self.commpress_state is None:
            self._commpress_pending = sd  # the hook is registered in setup, after this
        else:
            RankStates(self.commpress_state).load_state_dict(sd)
