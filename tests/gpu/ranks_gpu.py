"""Rank bodies for the GPU end-to-end tests (module level so ``spawn`` can pickle them)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import comms
from compressors.cuda import loader


class LaunchCounter:
    """Counts kernel launches by name (wraps ``loader.launch``)."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._orig = loader.launch

    def __enter__(self):
        def counted(name, *a, **kw):
            self.counts[name] = self.counts.get(name, 0) + 1
            return self._orig(name, *a, **kw)

        loader.launch = counted
        return self

    def __exit__(self, *exc):
        loader.launch = self._orig


def make_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def train_cuda(rank, spec, algorithm, steps=8, kernels=True, device_index=0):
    """Train on cuda:device_index through the compression hook; params (CPU) and launch counts."""
    os.environ["COMMPRESS_CUDA_KERNELS"] = "1" if kernels else "0"
    dev = torch.device("cuda", device_index)
    torch.cuda.set_device(dev)
    model = DDP(make_model().to(dev), device_ids=[device_index], bucket_cap_mb=0.1)
    if spec is not None:  # None: plain DDP (no hook)
        comms.register(model, spec, algorithm=algorithm)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with LaunchCounter() as lc:
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(32, 64, generator=g).to(dev)
            y = torch.randint(0, 10, (32,), generator=g).to(dev)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    torch.cuda.synchronize(dev)
    params = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.module.parameters()])
    return {"params": params, "launches": dict(lc.counts)}


def gloo_ranks_on_one_gpu(rank, world, cases, kernels=True):
    """Every rank on cuda:0 (CUDA tensors through gloo); ``kernels=False``: the torch path."""
    return [train_cuda(rank, spec, alg, kernels=kernels) for spec, alg in cases]


def nccl_world1(spec, algorithm, kernels):
    """One NCCL rank in a fresh process group (the NCCL hook path at world size 1)."""
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        return train_cuda(0, spec, algorithm, kernels=kernels)
    finally:
        dist.destroy_process_group()
