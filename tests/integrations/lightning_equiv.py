"""Lightning on 2 CPU ranks trains like ``comms.register(ddp, spec, optimizer=opt)`` (run by
test_integrations.py; Lightning's ``popen`` launcher re-runs this file for rank 1).

A Trainer with ``CommpressDDPStrategy(SPEC, algorithm="allgather")``, SGD lr 0.1 momentum 0.9 from
``configure_optimizers``, 60 steps on digits, ``CommpressStatsCallback`` into a CSV logger;
then, in the same processes, the reference run on plain DDP with the same model, data order
and steps. Writes ``rank{R}.json`` into argv[1]."""

import csv
import glob
import json
import os
import sys

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LR, MOMENTUM, SPEC, data, full_loss, make_net, reference  # noqa: E402

from comms.integrations.callback import CommpressStatsCallback  # noqa: E402
from comms.integrations.lightning import CommpressDDPStrategy  # noqa: E402

STEPS = 60


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_net()

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def train_dataloader(self):
        # the reference's order, pinned (Lightning's own sampler injection is turned off)
        ds = TensorDataset(*data())
        sampler = DistributedSampler(ds, num_replicas=2, rank=self.trainer.global_rank, shuffle=False)
        return DataLoader(ds, batch_size=16, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def main(out):
    strategy = CommpressDDPStrategy(SPEC, algorithm="allgather", process_group_backend="gloo")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS,
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, log_every_n_steps=1, use_distributed_sampler=False,
                        logger=CSVLogger(out, name="logs", version=0),
                        callbacks=[CommpressStatsCallback()])
    model = Net()
    trainer.fit(model)
    rank = trainer.global_rank
    st = strategy.commpress_state
    opt = trainer.optimizers[0]
    res = {"rank": rank, "lightning": full_loss(model.net), "iter": st.iter,
           "hook_momentum": st.momentum, "opt_momentum": opt.param_groups[0]["momentum"],
           "stats": strategy.commpress_stats,
           "reference": reference(rank, 2, STEPS, algorithm="allgather")}
    if rank == 0:
        rows = list(csv.DictReader(open(glob.glob(os.path.join(out, "logs", "version_0", "metrics.csv"))[0])))
        res["logged"] = {k: [float(r[k]) for r in rows if r.get(k)] for k in
                         ("commpress/wire_bytes", "commpress/dense_bytes", "commpress/ratio")}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
