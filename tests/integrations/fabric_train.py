"""Fabric on 2 CPU ranks (``torchrun --nproc_per_node 2``; run by test_integrations.py).
Writes ``rank{R}.json`` into argv[1].

1. ``register(fabric, model, SPEC, optimizer=opt, algorithm="allgather")``, 60 steps of 2
   micro-batches (``no_backward_sync``), then the reference ``comms.register`` run on plain DDP
   with the same model, data order and steps: the final losses must agree.
2. Resume: a checkpoint at step 30 through ``fabric.save`` with ``RankStates``, a fresh
   model/optimizer/hook loaded with ``load`` and the same last 30 steps end with the
   uninterrupted run's parameter bits. Loading a checkpoint without commpress state warns.
"""

import json
import os
import sys

import torch
import torch.nn as nn
from lightning.fabric import Fabric

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LR, MOMENTUM, SPEC, full_loss, make_net, rank_batches, reference  # noqa: E402

from comms.integrations.fabric import RankStates, load, register  # noqa: E402

STEPS, ACCUM = 60, 2


def setup(fabric):
    net = make_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM))
    state = register(fabric, model, SPEC, optimizer=opt, algorithm="allgather")
    return net, model, opt, state


def train(fabric, model, opt, first, last):
    batches = rank_batches(fabric.global_rank, fabric.world_size)
    for i in range(first * ACCUM, last * ACCUM):
        x, y = batches[i % len(batches)]
        syncing = i % ACCUM == ACCUM - 1
        with fabric.no_backward_sync(model, enabled=not syncing):
            fabric.backward(nn.functional.cross_entropy(model(x), y) / ACCUM)
        if syncing:
            opt.step()
            opt.zero_grad()


def flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def main(out):
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rank = fabric.global_rank
    net, model, opt, state = setup(fabric)
    train(fabric, model, opt, 0, STEPS // 2)
    ckpt, plain = os.path.join(out, "a.ckpt"), os.path.join(out, "plain.ckpt")
    fabric.save(ckpt, {"model": model, "optimizer": opt, "commpress": RankStates(state)})
    fabric.save(plain, {"model": model, "optimizer": opt})
    train(fabric, model, opt, STEPS // 2, STEPS)
    res = {"rank": rank, "fabric": full_loss(net), "iter": state.iter, "hook_momentum": state.momentum,
           "opt_momentum": opt.param_groups[0]["momentum"],
           "compressed": state.wire_bytes_per_step() < state.dense_bytes_per_step()}
    net2, model2, opt2, state2 = setup(fabric)
    load(fabric, ckpt, {"model": model2, "optimizer": opt2, "commpress": RankStates(state2)})
    res["resumed_iter"] = state2.iter
    train(fabric, model2, opt2, STEPS // 2, STEPS)
    res["resume_equal"] = torch.equal(flat(net), flat(net2))
    net3, model3, opt3, state3 = setup(fabric)
    load(fabric, plain, {"model": model3, "optimizer": opt3, "commpress": RankStates(state3)})
    res["plain_iter"] = state3.iter
    res["reference"] = reference(rank, 2, STEPS, accum=ACCUM, algorithm="allgather")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
