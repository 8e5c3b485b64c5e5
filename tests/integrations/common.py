"""What the integration scripts share: scikit-learn digits split per rank, a seeded MLP, the
full-data loss, and the reference run — ``comms.register(ddp, spec, optimizer=opt)`` on plain
DDP — every framework run must train like."""

from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import comms

__all__ = ["SPEC", "LR", "MOMENTUM", "data", "rank_batches", "make_net", "full_loss", "reference"]

SPEC = "topk:density=0.01"
LR, MOMENTUM = 0.1, 0.9
N = 1792  # digits has 1797 samples: 2 ranks x 56 batches of 16


def data():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data[:N], dtype=torch.float32) / 16.0
    return x, torch.tensor(d.target[:N], dtype=torch.long)


def rank_batches(rank: int, world: int, batch: int = 16) -> list:
    """Rank ``rank``'s batches in the order ``DistributedSampler(shuffle=False)`` gives them."""
    x, y = data()
    xs, ys = x[rank::world], y[rank::world]
    return [(xs[i:i + batch], ys[i:i + batch]) for i in range(0, len(xs), batch)]


def make_net() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
    return net


def full_loss(net: nn.Module) -> float:
    x, y = data()
    with torch.no_grad():
        return float(nn.functional.cross_entropy(net(x), y))


def reference(rank: int, world: int, steps: int, accum: int = 1, **options) -> float:
    """Full-data loss after ``steps`` optimizer steps of ``comms.register(ddp, SPEC,
    optimizer=opt, **options)`` (``accum`` micro-batches per step, ``no_sync`` on all but the
    last)."""
    net = make_net()
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)
    comms.register(ddp, SPEC, optimizer=opt, **options)
    batches = rank_batches(rank, world)
    for i in range(steps * accum):
        x, y = batches[i % len(batches)]
        last = i % accum == accum - 1
        with nullcontext() if last else ddp.no_sync():
            (nn.functional.cross_entropy(ddp(x), y) / accum).backward()
        if last:
            opt.step()
            opt.zero_grad()
    return full_loss(net)
