"""Rank bodies for the gloo tests (module level so ``spawn`` can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import comms


def make_model(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.to(dtype)


def batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g).to(dtype)
    y = torch.randint(0, 10, (16,), generator=g)
    return x, y


def flat_params(model):
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def train(rank, world, spec, steps=20, algorithm=None, bucket_cap_mb=0.01, hook_kw=None,
          return_grads=False):
    """Train a small MLP with the compression hook; return final params (and grads)."""
    torch.manual_seed(0)
    model = DDP(make_model(), bucket_cap_mb=bucket_cap_mb)
    state = None
    if spec is not None:
        kw = dict(hook_kw or {})
        if algorithm is not None:
            kw["algorithm"] = algorithm
        state = comms.register(model, spec, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    grads = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if return_grads:
            grads.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        opt.step()
    out = {"params": flat_params(model.module), "loss": float(loss.detach())}
    if return_grads:
        out["grads"] = grads
    if state is not None:
        out["stats"] = {b: s.as_dict() for b, s in state.stats.items()}
        out["iter"] = state.iter
    return out
