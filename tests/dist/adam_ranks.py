"""Rank bodies for the Adam momentum-space tests (module level so ``spawn`` pickles them)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import comms
from dist.fsdp_ranks import teacher_data
from dist.ranks import flat_params, make_model


def _setup(spec, lr=3e-3, algorithm="allgather", **kw):
    torch.manual_seed(0)
    model = DDP(make_model(), bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    state = None if spec is None else comms.register(model, spec, optimizer=opt, algorithm=algorithm, **kw)
    return model, opt, state


def _step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _batch(data, rank, world, step, per_rank=32):
    xt, yt = data[0], data[1]
    g = torch.Generator().manual_seed(10_000 + step)
    idx = torch.randint(0, xt.shape[0], (per_rank * world,), generator=g)[rank * per_rank:(rank + 1) * per_rank]
    return xt[idx], yt[idx]


def quality(rank, world, spec, steps, kw):
    """Held-out loss after ``steps`` AdamW steps on the teacher task (mean of the last 3
    evaluations), and the parameters (replica identity)."""
    data = teacher_data()
    model, opt, state = _setup(spec, **kw)
    evals = []
    for s in range(steps):
        _step(model, opt, *_batch(data, rank, world, s))
        if s % 10 == 9:
            with torch.no_grad():
                evals.append(float(nn.functional.cross_entropy(model.module(data[2]), data[3])))
    adam = None if state is None or state.adam is None else state.adam.state_dict()
    return {"final": sum(evals[-3:]) / 3, "params": flat_params(model.module), "adam": adam}


def resume(rank, world, spec, ckpt_dir, freeze, save_at, total):
    """Straight run vs save at ``save_at`` and resume into a fresh model/optimizer/state."""
    data = teacher_data()
    model, opt, state = _setup(spec, adam_freeze=freeze)
    for s in range(total):
        if s == save_at:
            path = os.path.join(ckpt_dir, f"r{rank}.pt")
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "comm": state.state_dict()}, path)
        _step(model, opt, *_batch(data, rank, world, s))
    straight = flat_params(model.module)
    frozen_at = state.adam.freeze_iter
    model, opt, state = _setup(spec, adam_freeze=freeze)
    ck = torch.load(path, weights_only=True)
    model.module.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["comm"])
    for s in range(save_at, total):
        _step(model, opt, *_batch(data, rank, world, s))
    return {"straight": straight, "resumed": flat_params(model.module), "frozen_at": frozen_at}
