"""Integrations with training frameworks (optional extras: ``pip install "commpress[integrations]"``).

* :mod:`comms.integrations.lightning` — ``CommpressDDPStrategy``: Lightning's ``DDPStrategy``
  that registers the commpress hook on CPU and GPU alike and keeps its per-rank state in
  Lightning checkpoints. Fabric: ``comms.register(fabric_model._forward_module, spec)``
  after ``fabric.setup(model)`` (see that module's docstring).
* :mod:`comms.integrations.accelerate` — ``register(accelerator, model, spec)``: the hook on
  the model ``accelerator.prepare`` returned (compiled models unwrapped), its state saved and
  restored by ``accelerator.save_state`` / ``load_state``.

Neither is imported by ``import comms``; each imports its framework when imported.

Example::

    >>> from comms.integrations.lightning import CommpressDDPStrategy
    >>> trainer = Trainer(strategy=CommpressDDPStrategy("topk:density=0.01"), devices=2)
"""

from .rank_states import RankStates

__all__ = ["RankStates"]
