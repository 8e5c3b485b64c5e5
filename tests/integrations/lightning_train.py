"""Lightning on 2 CPU ranks with CommpressDDPStrategy (run by test_integrations.py; Lightning's
``popen`` launcher re-runs this file for rank 1). Writes ``rank{R}.json`` into argv[1].

Run A: 1 epoch (4 steps), checkpoint. Run B: resume A's checkpoint, 2nd epoch. Run C: 2
epochs straight. B and C must end with the same parameter bits and commpress state. Run D:
resume A's checkpoint stripped of its commpress state and with the optimizer's momentum
back (as a plain-DDP run writes it): a WARNING, and the optimizer's momentum goes back to 0."""

import json
import os
import sys

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from comms.integrations.lightning import CHECKPOINT_KEY, CommpressDDPStrategy

SPEC = "topk:density=0.1"


class MLP(L.LightningModule):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader():
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(128, 32, generator=g), torch.randint(0, 10, (128,), generator=g))
    return DataLoader(ds, batch_size=16, shuffle=False)  # 2 ranks x 4 steps per epoch


def trainer(epochs):
    # no warm-up ramp (top-k's default): its first steps go dense, and run A's 4 steps must compress
    strategy = CommpressDDPStrategy(SPEC, start_iter=1, algorithm="allgather", warmup_steps=0,
                                    process_group_backend="gloo")
    return strategy, L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=epochs,
                               enable_progress_bar=False, logger=False, enable_checkpointing=False,
                               enable_model_summary=False)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main(out):
    ckpt = os.path.join(out, "a.ckpt")
    sa, ta = trainer(1)
    ma = MLP()
    ta.fit(ma, loader())
    ta.save_checkpoint(ckpt)
    sb, tb = trainer(2)
    mb = MLP()
    tb.fit(mb, loader(), ckpt_path=ckpt)
    sc, tc = trainer(2)
    mc = MLP()
    tc.fit(mc, loader())
    rank = tc.global_rank
    plain = torch.load(ckpt, weights_only=True)
    del plain[CHECKPOINT_KEY]
    for g in plain["optimizer_states"][0]["param_groups"]:
        g["momentum"] = 0.9
    plain_path = os.path.join(out, f"plain{rank}.ckpt")
    torch.save(plain, plain_path)
    sd, td = trainer(2)
    td.fit(MLP(), loader(), ckpt_path=plain_path)
    saved = torch.load(ckpt, weights_only=True)[CHECKPOINT_KEY]
    res = {
        "rank": rank,
        "iter_a": sa.commpress_state.iter, "iter_b": sb.commpress_state.iter, "iter_c": sc.commpress_state.iter,
        "compressed_a": sa.commpress_state.wire_bytes_per_step() < sa.commpress_state.dense_bytes_per_step(),
        "saved_world": saved["world"], "saved_iters": [r["iter"] for r in saved["ranks"]],
        "saved_residuals": [len(r["memory"]["residuals"]) for r in saved["ranks"]],
        "b_equals_c": torch.equal(flat(mb), flat(mc)),
        "a_differs_c": not torch.equal(flat(ma), flat(mc)),
        "residual_b_equals_c": all(torch.equal(sb.commpress_state.memory.residuals[k],
                                               sc.commpress_state.memory.residuals[k])
                                   for k in sc.commpress_state.memory.residuals),
        "params_c": flat(mc).tolist()[:8],
        "momenta_c": [sc.commpress_state.momentum, tc.optimizers[0].param_groups[0]["momentum"]],
        "momenta_d": [sd.commpress_state.momentum, td.optimizers[0].param_groups[0]["momentum"]],
        "iter_d": sd.commpress_state.iter,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
