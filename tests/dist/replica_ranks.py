"""Rank body of the long-run replica test: DDP training with odd shapes, tiny buckets,
SGD momentum 0.9 and different data per rank, ``comms.check_replicas`` every
``check_every`` steps, for many (spec, algorithm) cases in one process group.

The model holds the shapes that break careless post-collective arithmetic: an embedding
(50 x 16), a conv kernel (32 x 16 x 3) and 3 x 3 convolutions, a 5 x 384 and a 384 x 5
matrix, a matrix with fewer rows than the PowerSGD rank (2 x 9), LayerNorm vectors, and an
unused layer (``find_unused_parameters=True``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

import comms

__all__ = ["OddNet", "run_cases", "train_case"]


class OddNet(nn.Module):
    """Embedding -> Conv1d -> LayerNorm -> 384 x 5 -> 5 x 384 -> 3x3 conv -> 2 x 9 -> 5 logits."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.conv = nn.Conv1d(16, 32, 3)
        self.ln = nn.LayerNorm(32)
        self.down = nn.Linear(384, 5)     # weight 5 x 384
        self.up = nn.Linear(5, 384)       # weight 384 x 5
        self.conv2 = nn.Conv2d(1, 2, 3)   # 3x3 kernels, weight 2 x 1 x 3 x 3 (2 x 9)
        self.thin = nn.Linear(9, 2, bias=False)  # 2 x 9: fewer rows than rank 4
        self.head = nn.Linear(2 * 2 * 18 + 2, 5)
        self.unused = nn.Linear(7, 7)

    def forward(self, t):
        b = t.shape[0]
        h = self.conv(self.emb(t).transpose(1, 2)).transpose(1, 2)   # b, 12, 32
        h = self.ln(h).reshape(b, -1)                                  # b, 384
        z = self.down(h)                                               # b, 5
        h = torch.tanh(self.up(z)).view(b, 1, 4, 96)                   # b, 1, 4, 96
        c = self.conv2(h[..., :20])                                    # b, 2, 2, 18
        s = self.thin(h[:, 0, 0, :9])                                  # b, 2
        return self.head(torch.cat([c.reshape(b, -1), s], 1)) + z


def train_case(rank: int, world: int, spec: str, algorithm: str, steps: int, check_every: int,
               seed: int = 0) -> dict:
    """Train one case; raises ReplicaMismatchError (on every rank) at the first differing check."""
    torch.manual_seed(seed)
    model = OddNet()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True,
                                              bucket_cap_mb=0.01)
    state = comms.register(ddp, spec, algorithm=algorithm)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    checks = 0
    loss = torch.zeros(())
    for s in range(1, steps + 1):
        x = torch.randint(0, 50, (8, 14), generator=g)
        y = torch.randint(0, 5, (8,), generator=g)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if s % check_every == 0 or s == steps:
            comms.check_replicas(ddp)
            checks += 1
    compressed = sum(st.calls for st in state.stats.values() if st.algorithm == algorithm)
    return {"spec": spec, "algorithm": algorithm, "checks": checks, "compressed_calls": compressed,
            "finite": bool(torch.isfinite(loss)), "params": sum(p.numel() for p in model.parameters())}


def run_cases(rank: int, world: int, cases, steps: int, check_every: int) -> list:
    """Every ``(spec, algorithm)`` of ``cases`` in turn on the same process group."""
    return [train_case(rank, world, spec, alg, steps, check_every) for spec, alg in cases]


def guard_case(rank: int, world: int, steps: int, every: int, perturb_at: int | None):
    """Train with ``check_replicas_every=every``; at step ``perturb_at`` rank 1 nudges one
    element of ``up.weight`` by one ulp. Returns ``("ok", checks)`` or ``("raised", message)``."""
    torch.manual_seed(0)
    model = OddNet()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.01)
    state = comms.register(ddp, "powersgd:rank=2", algorithm="allreduce", check_replicas_every=every)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for s in range(steps):
        if s == perturb_at and rank == 1:
            with torch.no_grad():
                w = model.up.weight.view(-1)
                w[7] = torch.nextafter(w[7], torch.tensor(float("inf")))
        x = torch.randint(0, 50, (8, 14), generator=g)
        y = torch.randint(0, 5, (8,), generator=g)
        try:
            loss = nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - the test inspects the message
            return ("raised", s, type(exc).__name__, str(exc))
        opt.step()
    return ("ok", state.replica_guard.checks)
