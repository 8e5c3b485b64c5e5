"""Integrations with training frameworks (optional extras: ``pip install "commpress[integrations]"``).

Each trains like ``comms.register(ddp, spec, optimizer=opt, **options)`` on the same model:
every ``register`` option, the same optimizer pairing (SGD's momentum moves into the hook),
options validated before anything runs, every rank's state in the framework's checkpoints
(a WARNING when a checkpoint without it is loaded while compressing).

* :mod:`comms.integrations.lightning` — ``CommpressDDPStrategy`` (also
  ``strategy="commpress_ddp"`` with ``COMMPRESS_SPEC``); :mod:`comms.integrations.callback` —
  ``CommpressStatsCallback`` (wire bytes, ratio, autotune plan in Lightning's logger).
* :mod:`comms.integrations.fabric` — ``register(fabric, model, spec, optimizer=opt)``, ``load``.
* :mod:`comms.integrations.accelerate` — ``register(accelerator, model, spec, optimizer=opt)``
  (DDP or FSDP2), ``load_state``.
* :mod:`comms.integrations.transformers` — ``register(trainer, spec, **options)`` for a Hugging
  Face ``Trainer`` (one line before ``trainer.train()``; every rank's state in ``checkpoint-N``).
* :mod:`comms.integrations.pairing` — what they share (``check_options``,
  ``register_paired``, ``summary``), framework-free.

None is imported by ``import comms``; each imports its framework when imported.

Example::

    >>> from comms.integrations.lightning import CommpressDDPStrategy
    >>> trainer = Trainer(strategy=CommpressDDPStrategy("topk:density=0.01"), accelerator="cpu",
    ...                   devices=2)
"""

from .rank_states import RankStates

__all__ = ["RankStates"]
