"""Hugging Face ``Trainer``: ``register(trainer, spec, **options)`` — one added line, and the
Trainer trains like ``comms.register(ddp, spec, optimizer=opt, **options)`` on its own loop.

``Trainer`` builds its optimizer, wraps the model (Accelerate's DDP, ``trainer.model_wrapped``)
and restores a checkpoint inside ``train()``; a callback's ``on_train_begin`` sees the
unwrapped model and overriding ``create_optimizer`` runs before the wrap. So ``register``
attaches a :class:`CommpressCallback` that holds the trainer and, at ``on_train_begin`` (after
the wrap and after a resumed optimizer was loaded):

* registers :func:`comms.register` on ``trainer.model_wrapped`` with every option it takes,
  paired with Trainer's optimizer as ``optimizer=opt`` does (SGD's momentum moves into the
  hook; AdamW with top-k, random-k or sign compresses in momentum space, ``adam_freeze``);
  an FSDP2 model (``fsdp_version=2``) goes to :func:`comms.fsdp.register`; one process: a
  ``UserWarning`` and nothing registered;
* on ``train(resume_from_checkpoint=...)`` loads this rank's ``commpress.rank{R}.pt`` from
  the checkpoint folder (residuals, velocities, the Adam freeze, the autotune plan): the run
  resumes bitwise; a folder without it logs a WARNING (the residuals restart from zero).

``on_save`` writes every rank's state into Trainer's own ``checkpoint-N`` folder
(``args.output_dir``; hyperparameter-search runs are not covered). Gradient accumulation works
unchanged (the hook runs on the synchronizing micro-step). :class:`CommpressStatsCallback`
(added by default) puts ``commpress/wire_bytes``, ``commpress/dense_bytes``,
``commpress/ratio`` and, with ``algorithm="auto"``, ``commpress/locked``,
``commpress/plan_compressed``, ``commpress/tuning_steps`` into every log Trainer writes
(``trainer.state.log_history`` and each ``report_to`` integration). Options are validated in
``register``, before ``train()``.

Example (``torchrun --nproc-per-node 2 train.py``; on CPU ``use_cpu=True, ddp_backend="gloo"``)::

    from transformers import Trainer, TrainingArguments
    from comms.integrations.transformers import register

    trainer = Trainer(model=model, args=TrainingArguments("out", save_steps=100), train_dataset=ds)
    cb = register(trainer, "topk:density=0.01", algorithm="allgather")
    trainer.train()                              # or train(resume_from_checkpoint=True)
    print(cb.state.report())
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..core.checkpoint import owner
from .pairing import check_options, find_ddp, register_model, summary, warn_no_state

__all__ = ["register", "CommpressCallback", "CommpressStatsCallback", "STATE_FILE"]

#: this rank's file in a checkpoint folder (``STATE_FILE.format(rank=R)``)
STATE_FILE = "commpress.rank{rank}.pt"


def register(trainer, compressor, *, stats: bool = True, **options) -> "CommpressCallback":
    """Compress the gradients of ``trainer``'s runs (call before ``trainer.train()``).

    Args:
        trainer: a ``transformers.Trainer`` (or a subclass: ``Seq2SeqTrainer``, TRL's, ...).
        compressor: a :class:`compressors.Compressor` or a spec string.
        stats: also add :class:`CommpressStatsCallback` (commpress numbers in every log).
        **options: as :func:`comms.register` (``algorithm``, ``momentum``, ``clip_norm``,
            ``warmup_steps``, ``adam_freeze``, ``timeout``, ``check_replicas_every``, ...).

    Returns:
        The :class:`CommpressCallback`; its ``state`` is the hook state from the start of
        training (``None`` before, and on one process).

    Raises:
        TypeError / ValueError: a bad spec or option, naming it (nothing is attached); a
            second ``register`` on the same trainer.
    """
    if any(isinstance(cb, CommpressCallback) for cb in trainer.callback_handler.callbacks):
        raise ValueError("this Trainer already compresses with commpress (register was called)")
    check_options(compressor, options)
    cb = CommpressCallback(trainer, compressor, **options)
    trainer.add_callback(cb)
    if stats:  # first, so the reporting callbacks see what it adds to the logs
        trainer.callback_handler.callbacks.insert(0, CommpressStatsCallback(cb))
    _capture_resume(trainer, cb)
    return cb


def _capture_resume(trainer, cb: "CommpressCallback") -> None:
    """Note the checkpoint ``trainer.train`` resumes from (Trainer passes it to no callback)."""
    train = trainer.train

    @functools.wraps(train)
    def train_and_resume(resume_from_checkpoint=None, *args, **kwargs):
        path = resume_from_checkpoint
        if path is True:  # Trainer's own rule (it raises when there is none)
            path = get_last_checkpoint(trainer.args.output_dir)
        cb.resume_from = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_and_resume


class CommpressCallback(TrainerCallback):
    """Registers the hook when training starts; saves and restores each rank's state with
    Trainer's checkpoints. Attach with :func:`register` (it needs the trainer).

    Attributes:
        state: the hook state (``None`` before training starts and on one process).
        resume_from: the checkpoint folder the current ``train()`` resumes from, or ``None``.
    """

    def __init__(self, trainer, compressor, **options: Any):
        self.trainer, self.compressor, self.options = trainer, compressor, options
        self.state = None
        self.resume_from: str | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        ddp = find_ddp(trainer.model_wrapped)
        current = getattr(ddp, "_commpress_state", None)
        if current is None or current is not self.state:  # a second train() keeps its hook
            self.state = register_model(
                trainer.model_wrapped, self.compressor, [trainer.optimizer], dict(self.options),
                world_size=args.world_size, framework="Hugging Face Trainer",
                fix="commpress needs Trainer's multi-process DDP (torchrun, accelerate launch) "
                    "or FSDP2 (fsdp_config={'fsdp_version': 2}); DeepSpeed and FSDP1 have no "
                    "communication hook")
        if self.state is not None and self.resume_from is not None:
            self._load(self.resume_from, args.device)

    def _load(self, folder: str, device) -> None:
        name = STATE_FILE.format(rank=owner()["rank"])
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            self.state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True),
                                       device=device)
            return
        warn_no_state(f"{folder} (no {name})", self.state.compressor.spec(), [self.state])

    def on_save(self, args, state, control, **kwargs):
        if self.state is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, STATE_FILE.format(rank=owner()["rank"]))
        torch.save(self.state.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)  # a reader never sees half a file


class CommpressStatsCallback(TrainerCallback):
    """Adds commpress' numbers (:func:`~comms.integrations.pairing.summary`) to every log.

    Trainer hands the same ``logs`` dict to each callback's ``on_log`` in turn, so this
    callback goes first (:func:`register` puts it there); it also updates the entry Trainer
    just appended to ``state.log_history``.

    Args:
        source: the :class:`CommpressCallback` whose state is logged.
        prefix: metric name prefix.
    """

    def __init__(self, source: CommpressCallback, prefix: str = "commpress/"):
        self.source, self.prefix = source, prefix

    def metrics(self) -> dict[str, float]:
        """The metrics of the current state (empty before training starts)."""
        if self.source.state is None:
            return {}
        s, p = summary(self.source.state), self.prefix
        out = {p + "wire_bytes": float(s["wire_bytes"]), p + "dense_bytes": float(s["dense_bytes"]),
               p + "ratio": s["ratio"]}
        if "locked" in s:
            out.update({p + "locked": float(s["locked"]), p + "tuning_steps": float(s["tuning_steps"]),
                        p + "plan_compressed": float(bool(s["plan"]) and s["plan"] != "dense")})
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        extra = self.metrics()
        if logs is None or not extra:
            return
        logs.update(extra)
        if state.log_history:
            state.log_history[-1].update(extra)
