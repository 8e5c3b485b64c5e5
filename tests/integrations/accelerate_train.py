"""Accelerate on 2 CPU ranks (``torchrun --nproc_per_node 2``; run by test_integrations.py).
Writes ``rank{R}.json`` into argv[1].

1. ``register(acc, model, SPEC, optimizer=opt, algorithm="allgather")`` with 2-step gradient
   accumulation (``accelerator.accumulate``), 60 steps, then the reference ``comms.register``
   run on plain DDP with the same model, data order and steps: the final losses must agree.
2. Resume: ``save_state`` at step 30; a fresh model, optimizer and hook (on the
   ``torch.compile``'d model: the helper looks through it), ``load_state`` and the same last 30
   steps end with the uninterrupted run's parameter bits and residuals.
3. A folder saved without commpress state loads through ``load_state`` with a WARNING.
"""

import json
import os
import sys

import torch
import torch.nn as nn
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LR, MOMENTUM, SPEC, full_loss, make_net, rank_batches, reference  # noqa: E402

from comms.integrations.accelerate import load_state, register  # noqa: E402
from comms.integrations.rank_states import RankStates  # noqa: E402

STEPS, ACCUM = 60, 2


def setup(acc, compile_=False):
    net = make_net()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM))
    target = torch.compile(model, backend="eager") if compile_ else model
    state = register(acc, target, SPEC, optimizer=opt, algorithm="allgather")
    return net, model, opt, state


def train(acc, model, opt, first, last):
    batches = rank_batches(acc.process_index, acc.num_processes)
    for i in range(first * ACCUM, last * ACCUM):
        x, y = batches[i % len(batches)]
        with acc.accumulate(model):
            acc.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()


def flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def fresh(acc):
    acc._models.clear(); acc._optimizers.clear(); acc._custom_objects.clear()
    acc.step = 0


def main(out):
    acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    rank = acc.process_index
    ckpt, plain = os.path.join(out, "state"), os.path.join(out, "plain")
    net, model, opt, state = setup(acc)
    train(acc, model, opt, 0, STEPS // 2)
    acc.save_state(ckpt)
    kept = list(acc._custom_objects)
    acc._custom_objects.clear()  # a folder as a run without commpress would write it
    acc.save_state(plain)
    acc._custom_objects.extend(kept)
    train(acc, model, opt, STEPS // 2, STEPS)
    res = {"rank": rank, "world": acc.num_processes, "accelerate": full_loss(net), "iter": state.iter,
           "hook_momentum": state.momentum, "opt_momentum": opt.param_groups[0]["momentum"],
           "compressed": state.wire_bytes_per_step() < state.dense_bytes_per_step()}

    fresh(acc)
    net2, model2, opt2, state2 = setup(acc, compile_=True)
    load_state(acc, ckpt)
    res["resumed_iter"] = state2.iter
    train(acc, model2, opt2, STEPS // 2, STEPS)
    res["equal"] = torch.equal(flat(net), flat(net2))
    res["residuals_equal"] = all(torch.equal(state.memory.residuals[k], state2.memory.residuals[k])
                                 for k in state.memory.residuals)

    fresh(acc)
    net3, model3, opt3, state3 = setup(acc)
    load_state(acc, plain)
    res["plain_iter"] = state3.iter
    res["plain_objects_back"] = sum(isinstance(o, RankStates) for o in acc._custom_objects)
    res["reference"] = reference(rank, 2, STEPS, accum=ACCUM, algorithm="allgather")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
