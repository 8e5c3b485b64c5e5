"""Accelerate on 2 CPU ranks (``torchrun --nproc_per_node 2``; run by test_integrations.py).
Writes ``rank{R}.json`` into argv[1].

4 steps, ``save_state``, 4 more (run A). Then a fresh model/optimizer, ``prepare``, register,
``load_state`` and the same 4 steps (run B): B must end with A's parameter bits."""

import json
import os
import sys

import torch
import torch.nn as nn
from accelerate import Accelerator

from comms.integrations.accelerate import register


def make(seed):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def steps(acc, model, opt, first, last):
    for step in range(first, last):
        g = torch.Generator().manual_seed(1000 * step + acc.process_index)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        acc.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main(out):
    acc = Accelerator(cpu=True)
    ckpt = os.path.join(out, "state")
    model = make(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    state = register(acc, model, "sign", start_iter=1, algorithm="allgather")
    steps(acc, model, opt, 0, 4)
    acc.save_state(ckpt)
    steps(acc, model, opt, 4, 8)
    a = flat(model)

    acc2 = acc  # the same Accelerator; a fresh model, optimizer and state
    acc2._models.clear(); acc2._optimizers.clear(); acc2._custom_objects.clear()
    model2 = make(5)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    model2, opt2 = acc2.prepare(model2, opt2)
    compiled = torch.compile(model2, backend="eager")  # the helper looks through compile
    state2 = register(acc2, compiled, "sign", start_iter=1, algorithm="allgather")
    acc2.load_state(ckpt)
    resumed_iter = state2.iter
    steps(acc2, model2, opt2, 4, 8)
    res = {"rank": acc.process_index, "world": acc.num_processes, "iter": state.iter,
           "resumed_iter": resumed_iter, "equal": torch.equal(a, flat(model2)),
           "compressed": state.wire_bytes_per_step() < state.dense_bytes_per_step(),
           "residuals_equal": all(torch.equal(state.memory.residuals[k], state2.memory.residuals[k])
                                  for k in state.memory.residuals)}
    with open(os.path.join(out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
