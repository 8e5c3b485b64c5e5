"""The Hugging Face Trainer integration in one process: options checked in ``register``
(nothing attached on bad input), the callbacks' order, and a one-process run (nothing to
communicate: a warning, no hook). Two ranks: test_integrations.py."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from comms.integrations.transformers import (CommpressCallback, CommpressStatsCallback,  # noqa: E402
                                             register)

TOPK = "topk:density=0.01"


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def forward(self, x, labels=None):
        out = self.layer(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def _trainer(tmp_path):
    ds = [{"x": torch.full((4,), float(i)), "labels": torch.ones(1)} for i in range(8)]
    args = transformers.TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                          use_cpu=True, report_to="none", disable_tqdm=True,
                                          save_strategy="no", logging_steps=1)
    return transformers.Trainer(model=_Net(), args=args, train_dataset=ds)


@pytest.mark.parametrize("options, error, match", [
    (dict(algorithm="two-phase"), ValueError, "unknown algorithm 'two-phase'"),
    (dict(adam_freeze=0), ValueError, "adam_freeze must be"),
    (dict(momentun=0.9), TypeError, r"unknown commpress option\(s\) \['momentun'\]"),
    (dict(check_replicas_every=True), TypeError, "check_replicas_every"),
    (dict(sync_every=4, momentum=0.9), ValueError, r"\['momentum'\] configure per-step"),
])
def test_register_checks_options_before_attaching_anything(tmp_path, options, error, match):
    trainer = _trainer(tmp_path)
    before = list(trainer.callback_handler.callbacks)
    with pytest.raises(error, match=match):
        register(trainer, TOPK, **options)
    assert trainer.callback_handler.callbacks == before


def test_register_attaches_once_stats_first_and_runs_on_one_process(tmp_path):
    trainer = _trainer(tmp_path)
    cb = register(trainer, TOPK, algorithm="allgather", adam_freeze=5, clip_norm=1.0)
    callbacks = trainer.callback_handler.callbacks
    assert isinstance(callbacks[0], CommpressStatsCallback) and callbacks[0].source is cb
    assert isinstance(callbacks[-1], CommpressCallback)
    with pytest.raises(ValueError, match="already compresses"):
        register(trainer, TOPK)
    with pytest.warns(UserWarning, match="one process"):
        trainer.train()
    assert cb.state is None and cb.resume_from is None  # nothing to communicate
    assert all("commpress/wire_bytes" not in e for e in trainer.state.log_history)
