"""Lightning as a user sets it up, against ``comms.register`` (run by test_integrations.py;
Lightning's ``popen`` launcher re-runs this file for rank 1). Writes ``rank{R}.json`` into argv[1].

A small CNN on scikit-learn's digits, SGD lr 0.05 momentum 0.9 from ``configure_optimizers``,
72 steps on 2 CPU ranks, ``CommpressDDPStrategy("topk:density=0.01", algorithm="allgather")``,
``deterministic=True``, a ``ModelCheckpoint``, a shuffled ``DataLoader`` (Lightning injects
its ``DistributedSampler``). Then, in the same processes, the same model, data order and steps
with ``comms.register(ddp, spec, optimizer=opt)`` on plain DDP, and with plain DDP alone."""

import json
import os
import sys

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import comms
from comms.integrations.lightning import CHECKPOINT_KEY, CommpressDDPStrategy

SPEC, STEPS, BATCH, LR, MOMENTUM = "topk:density=0.01", 72, 32, 0.05, 0.9


def digits() -> TensorDataset:
    from sklearn.datasets import load_digits

    d = load_digits()
    return TensorDataset(torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0,
                         torch.tensor(d.target))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(),
                         nn.Linear(64, 10))


class DigitsCNN(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = cnn()

    def training_step(self, batch, _):
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def full_loss(net: nn.Module) -> float:
    x, y = digits().tensors
    with torch.no_grad():
        return float(nn.functional.cross_entropy(net(x), y))


def loop(rank: int, world: int, spec=None, **options) -> nn.Module:
    """The reference: Lightning's sampler order (shuffled, seed 0, one epoch after another)."""
    net = cnn()
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    if spec is not None:
        comms.register(ddp, spec, optimizer=opt, **options)
    ds = digits()
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    step, epoch = 0, 0
    while step < STEPS:
        sampler.set_epoch(epoch)
        for x, y in DataLoader(ds, batch_size=BATCH, sampler=sampler):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            step += 1
            if step == STEPS:
                break
        epoch += 1
    return net


def flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def main(out):
    strategy = CommpressDDPStrategy(SPEC, algorithm="allgather", process_group_backend="gloo")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS,
                        deterministic=True, callbacks=[ModelCheckpoint(dirpath=os.path.join(out, "ckpt"))],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    model = DigitsCNN()
    trainer.fit(model, DataLoader(digits(), batch_size=BATCH, shuffle=True))
    rank, world, st = trainer.global_rank, trainer.world_size, strategy.commpress_state
    ref, plain = loop(rank, world, SPEC, algorithm="allgather"), loop(rank, world)
    saved = [os.path.join(out, "ckpt", f) for f in sorted(os.listdir(os.path.join(out, "ckpt")))]
    res = {"rank": rank, "lightning": full_loss(model.net), "register": full_loss(ref),
           "ddp": full_loss(plain), "bitwise": torch.equal(flat(model.net), flat(ref)),
           "iter": st.iter, "compressed": 0 < st.wire_bytes_per_step() < st.dense_bytes_per_step(),
           "momenta": [st.momentum, trainer.optimizers[0].param_groups[0]["momentum"]],
           "checkpoint_has_state": bool(saved) and CHECKPOINT_KEY in torch.load(saved[-1], weights_only=False)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
