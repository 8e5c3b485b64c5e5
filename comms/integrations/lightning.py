"""Lightning: ``CommpressDDPStrategy``, a ``DDPStrategy`` that compresses gradients.

It trains like ``comms.register(ddp, spec, optimizer=opt, **options)`` on the same model:

* every ``comms.register`` option is an argument (``algorithm``, ``momentum``, ``clip_norm``,
  ``warmup_steps``, ...; the commpress wait bound is ``commpress_timeout``, since
  ``timeout`` is ``DDPStrategy``'s process-group timeout), validated in ``__init__``, before
  any process starts (a bad spec, an unknown algorithm, an algorithm the compressor cannot
  run, a bad option type, an argument neither commpress nor DDP knows);
* the hook is registered after Lightning built the optimizers, and pairs with them as
  ``register(..., optimizer=opt)`` does: SGD's momentum moves into the hook and the
  optimizer's goes to 0 (several optimizers: one shared momentum or none, else a
  ``ValueError`` with the reason; :func:`~comms.integrations.pairing.register_paired`);
* the hook goes on CPU and GPU alike (Lightning's own ``ddp_comm_hook`` only on CUDA);
* every rank's state (residuals, velocities, step, layouts, locked plan) is in the Lightning
  checkpoint under ``"commpress"``; a checkpoint without it logs a WARNING (the residuals
  restart from zero), and an optimizer restored with momentum is set back to 0;
* ``strategy="commpress_ddp"`` (or ``"commpress_ddp_spawn"``) by name, with the spec from the
  ``COMMPRESS_SPEC`` environment variable — importing this module registers the names;
  in a LightningCLI YAML use the class path (all options)::

      trainer:
        strategy:
          class_path: comms.integrations.lightning.CommpressDDPStrategy
          init_args: {compressor: "topk:density=0.01", algorithm: allgather}

Where the state is: ``strategy.commpress_state`` on every rank during and after ``fit``
(popen launch, the default). With ``start_method="spawn"`` the ranks are child processes: the
parent's ``commpress_state`` stays ``None`` and ``strategy.commpress_report`` /
``strategy.commpress_stats`` hold rank 0's report and :func:`~comms.integrations.pairing.summary`
after ``fit``. :class:`~comms.integrations.callback.CommpressStatsCallback` logs the stats.

Example (``python train.py`` on one CPU machine: Lightning starts rank 1 by running the file
again)::

    import lightning as L, torch
    from torch.utils.data import DataLoader, TensorDataset
    from comms.integrations.callback import CommpressStatsCallback
    from comms.integrations.lightning import CommpressDDPStrategy

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                           torch.nn.Linear(256, 1))
        def training_step(self, batch, _):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        def configure_optimizers(self):  # its momentum moves into the hook
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    if __name__ == "__main__":
        x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
        loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
        strategy = CommpressDDPStrategy("topk:density=0.01", algorithm="allgather")
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2,
                            callbacks=[CommpressStatsCallback()])
        trainer.fit(Regressor(), loader)
        if trainer.global_rank == 0:
            print(strategy.commpress_report)
"""

from __future__ import annotations

import inspect
import io
import logging
import os
from typing import Any, Mapping, Optional, Union

import torch
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch.nn.parallel import DistributedDataParallel

from ..core.checkpoint import settle
from ..core.pairing import check_optimizer, mark_paired, take_over_momentum
from .pairing import (REGISTER_OPTIONS, check_options, register_paired, repair_momentum, summary,
                      unwrap_optimizer, warn_no_state)
from .rank_states import RankStates

__all__ = ["CommpressDDPStrategy", "CHECKPOINT_KEY", "SPEC_ENV", "STRATEGY_NAME"]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "commpress"
#: the environment variable ``strategy="commpress_ddp"`` reads the spec from
SPEC_ENV = "COMMPRESS_SPEC"
STRATEGY_NAME = "commpress_ddp"

_HOOK_ARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")


#: the strategy's argument for a ``comms.register`` option of another name
_ARGUMENT = {"timeout": "commpress_timeout"}


def _default(argument: str):
    return inspect.signature(CommpressDDPStrategy.__init__).parameters[argument].default


def _check_ddp_kwargs(kwargs: dict) -> None:
    """No DDP hook arguments (DDP takes one hook), nothing neither DDPStrategy nor DDP knows."""
    for k in _HOOK_ARGS:
        if kwargs.get(k) is not None:
            raise ValueError(f"CommpressDDPStrategy registers its own DDP hook; {k} is not allowed")
    unknown = sorted(set(kwargs) - _known_ddp_args())
    if unknown:
        raise TypeError(f"CommpressDDPStrategy got unknown argument(s) {unknown}: neither a "
                        "commpress option nor a DDPStrategy / DistributedDataParallel argument")


def _known_ddp_args() -> set[str]:
    """What ``DDPStrategy`` and ``DistributedDataParallel`` accept (the rest would fail at fit)."""
    names = set(inspect.signature(DDPStrategy.__init__).parameters)
    names |= set(inspect.signature(DistributedDataParallel.__init__).parameters)
    return names - {"self", "kwargs", "module"}


class CommpressDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with the commpress hook, paired with Lightning's optimizers.

    Args:
        compressor: a spec string (``"topk:density=0.01"``) or a :class:`compressors.Compressor`;
            ``None``: the ``COMMPRESS_SPEC`` environment variable.
        algorithm, momentum, momentum_masking, clip_norm, residual_bound, warmup_steps,
            error_feedback, start_iter, seed, min_compress_numel, autotune, autotune_steps,
            check_replicas_every, adam_freeze, sync_every, sync_fragments, sync_delay, outer,
            outer_lr, outer_momentum: as :func:`comms.register` (defaults are its defaults, and
            only what differs from them reaches it: ``adam_freeze="auto"`` is the default
            whatever the optimizer; an int needs an Adam/AdamW that pairs).
            ``momentum=None`` takes SGD's momentum over from the optimizer.
        commpress_timeout: ``comms.register``'s ``timeout`` (seconds any commpress wait may
            last); ``None``: the process group's, i.e. this strategy's ``timeout``.
        **kwargs: ``DDPStrategy`` and ``DistributedDataParallel`` arguments
            (``process_group_backend``, ``start_method``, ``find_unused_parameters``, ...).

    Raises:
        ValueError / TypeError: a missing or bad spec, an unknown or unsupported algorithm, a
            bad option, an argument unknown to commpress, ``DDPStrategy`` and DDP, or a DDP hook
            argument (DDP takes one hook) — all here, before any process starts.
    """

    def __init__(self, compressor: Union[str, Any, None] = None, *, algorithm: Optional[str] = "auto",
                 momentum: Optional[float] = None, momentum_masking: Union[str, bool] = "held",
                 clip_norm: Optional[float] = None, residual_bound: Union[float, str, None] = "auto",
                 warmup_steps: Union[int, str] = "auto", error_feedback: Optional[bool] = None,
                 start_iter: int = 2, seed: int = 0, min_compress_numel: int = 0,
                 autotune: bool = True, autotune_steps: int = 2,
                 commpress_timeout: Optional[float] = None, check_replicas_every: Optional[int] = None,
                 adam_freeze: Union[str, int, None] = "auto", sync_every: Union[int, str, None] = None,
                 sync_fragments: Optional[int] = None, sync_delay: Optional[int] = None,
                 outer: Optional[str] = None, outer_lr: Optional[float] = None,
                 outer_momentum: Optional[float] = None, **kwargs: Any):
        named = dict(locals())
        _check_ddp_kwargs(kwargs)
        if compressor is None:
            compressor = os.environ.get(SPEC_ENV) or None
            if compressor is None:
                raise ValueError(f"CommpressDDPStrategy needs a compressor spec: pass "
                                 f"compressor=... or set {SPEC_ENV} (e.g. {SPEC_ENV}=topk:density=0.01)")
        self.commpress_options = {o: named[_ARGUMENT.get(o, o)] for o in REGISTER_OPTIONS}
        # what differs from register's defaults (which these are) goes to register
        self._commpress_given = {o: v for o, v in self.commpress_options.items()
                                 if v != _default(_ARGUMENT.get(o, o))}
        self.commpress_compressor = check_options(compressor, self._commpress_given).compressor
        super().__init__(**kwargs)
        self.commpress_state = None
        self._commpress_pending: Optional[dict] = None
        self._commpress_spawned: Optional[dict] = None  # rank 0's results after a spawn launch

    # -- where the state is -------------------------------------------------------------
    @property
    def commpress_stats(self) -> Optional[dict]:
        """:func:`~comms.integrations.pairing.summary` of this rank's state (after a spawn
        launch, in the parent: rank 0's); ``None`` before ``fit``."""
        if self.commpress_state is not None:
            return summary(self.commpress_state)
        return None if self._commpress_spawned is None else self._commpress_spawned["stats"]

    @property
    def commpress_report(self) -> Optional[str]:
        """``commpress_state.report()`` (after a spawn launch, in the parent: rank 0's)."""
        if self.commpress_state is not None:
            return self.commpress_state.report()
        return None if self._commpress_spawned is None else self._commpress_spawned["report"]

    # -- registration, after Lightning built the optimizers ------------------------------
    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers hooks on CUDA only, and before the optimizers exist: the
        # commpress hook is registered in setup_optimizers, paired with them
        self.commpress_state = None

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        if not isinstance(self.model, DistributedDataParallel):
            return  # not fitting: nothing is reduced
        state = getattr(self.model, "_commpress_state", None)
        if state is None:
            self.commpress_state = register_paired(self.model, self.commpress_compressor,
                                                   self.optimizers, **self._commpress_given)
            if self._commpress_pending:  # restored before setup
                RankStates(self.commpress_state).load_state_dict(self._commpress_pending)
            elif self._commpress_pending is not None:  # a checkpoint without it, reported
                settle(self.commpress_state)
            self._commpress_pending = None
            return
        for opt in map(unwrap_optimizer, self.optimizers):  # optimizers rebuilt on the same model
            momenta = {float(g.get("momentum", 0.0) or 0.0) for g in opt.param_groups}
            if self.commpress_options["momentum"] is None and momenta == {state.momentum}:
                take_over_momentum(opt)  # the momentum the hook took over at registration
            check_optimizer(state, opt)
            mark_paired(opt, state.momentum)

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        # every rank is here (Trainer.save_checkpoint is collective): gather, rank 0 writes
        if self.commpress_state is not None:
            checkpoint[CHECKPOINT_KEY] = RankStates(self.commpress_state).state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        sd = checkpoint.get(CHECKPOINT_KEY)
        if sd is None:
            if self.global_rank == 0:
                trainer = getattr(self.lightning_module, "_trainer", None)
                warn_no_state(getattr(trainer, "ckpt_path", None) or "being restored",
                              self.commpress_compressor.spec())
            if self.commpress_state is None:
                self._commpress_pending = {}  # reported: settled once registered
            else:
                settle(self.commpress_state)
            return
        if self.commpress_state is None:
            self._commpress_pending = sd  # the hook is registered in setup, after this
        else:
            RankStates(self.commpress_state).load_state_dict(sd)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        # a checkpoint of a run without the take-over brings the optimizer's momentum back
        repair_momentum(self.commpress_state, self.optimizers, "the checkpoint")

    # -- spawn: rank 0's results reach the parent -----------------------------------------
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = _CommpressLauncher(self, start_method=self._start_method)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in ((STRATEGY_NAME, "popen"), (STRATEGY_NAME + "_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"commpress DDP (spec from "
                                           f"${SPEC_ENV}), start_method {start_method!r}",
                                           start_method=start_method)


class _CommpressLauncher(_MultiProcessingLauncher):
    """Sends rank 0's commpress report and stats back to the parent process."""

    def get_extra_results(self, trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        state = getattr(trainer.strategy, "commpress_state", None)
        if state is not None:
            buf = io.BytesIO()
            torch.save({"report": state.report(), "stats": summary(state)}, buf)
            extra["commpress_bytes"] = buf.getvalue()
        return extra

    def update_main_process_results(self, trainer, extra: dict[str, Any]) -> None:
        raw = extra.pop("commpress_bytes", None)
        super().update_main_process_results(trainer, extra)
        if raw is not None:
            trainer.strategy._commpress_spawned = torch.load(io.BytesIO(raw), weights_only=True)


CommpressDDPStrategy.register_strategies(StrategyRegistry)
