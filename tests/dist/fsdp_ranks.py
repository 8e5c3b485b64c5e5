"""Rank bodies for the FSDP2 / HSDP gloo tests (module level so ``spawn`` can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import comms
from dist.ranks import batch

SPECS = ["fp16", "bf16", "qsgd:bits=4", "sign", "topk:density=0.1", "randomk:density=0.2"]


def make_model(seed=0):
    """An MLP whose layers' dim 0 (64, 64, 10) exercise FSDP's padding at 4 shards."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def shard_model(model, mesh):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_shards(model) -> torch.Tensor:
    return torch.cat([p.to_local().detach().reshape(-1).clone() for p in model.parameters()])


def full_params(model) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def set_local_shards_(model, flat: torch.Tensor) -> None:
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            t = p.to_local()
            t.copy_(flat[off: off + t.numel()].view_as(t))
            off += t.numel()


def steps(model, opt, rank, first, last, losses=None):
    for step in range(first, last):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(loss.item())


def fsdp_run(rank, world, spec, n_steps=20, momentum=0.9, **kw):
    """FSDP2 on a 1-D mesh; ``spec=None``: plain FSDP2. Returns full params, shards, losses."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh)
    state = comms.fsdp.register(model, spec, **kw) if spec is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    losses = []
    steps(model, opt, rank, 0, n_steps, losses)
    return {"full": full_params(model), "local": local_shards(model), "losses": losses,
            "report": state.report() if state else "", "nonfinite": state.nonfinite_modules if state else 0,
            "residual_bytes": state.residual_bytes() if state else 0}


def identity_vs_plain(rank, world):
    return fsdp_run(rank, world, None), fsdp_run(rank, world, "identity")


def compressed_runs(rank, world, specs):
    return {s: (fsdp_run(rank, world, s), fsdp_run(rank, world, s)) for s in specs}
