"""`make demo`: 2 gloo ranks on this machine train an MLP on scikit-learn's digits with
dense allreduce and with compressed hooks, and print one comparison table.

    python bench/demo.py [--ranks 2] [--steps 300] [--hooks dense,topk:density=0.01,...]

The digits data ships inside scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # for harness; last, so that
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/*.py never shadow packages
import harness  # noqa: E402  (puts the repository root first on sys.path)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import comms  # noqa: E402
import compressors  # noqa: E402
from comms.cluster.launch import spawn  # noqa: E402

__all__ = ["main", "load_digits_split", "run_rank"]

logger = logging.getLogger(__name__)

# spec[@algorithm]: no algorithm = the compressor's own family (so the demo shows compression;
# on this tiny model over loopback, `auto` rightly measures dense as fastest — its row shows that)
DEFAULT_HOOKS = ["dense", "topk:density=0.01", "qsgd:bits=4", "sign", "qsgd:bits=4@auto"]


def load_digits_split(seed: int = 0):
    """Digits (1797 x 64, 10 classes) scaled to [0, 1]; fixed 80/20 split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    cut = int(0.8 * len(y))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # same init on every rank (DDP also broadcasts rank 0's)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def run_rank(rank: int, world: int, hooks: list[str], steps: int, batch: int, lr: float):
    xtr, ytr, xte, yte = load_digits_split()
    shard = torch.arange(rank, len(ytr), world)  # each rank its own slice of the data
    xs, ys = xtr[shard], ytr[shard]
    rows = []
    for spec in hooks:
        model = DDP(make_mlp())
        name, _, alg = spec.partition("@")
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        # optimizer=: the hook takes SGD's momentum over where error feedback needs it (the
        # optimizer then runs with momentum 0; README "Usage")
        state = None if spec == "dense" else comms.register(model, name, algorithm=alg or None,
                                                           optimizer=opt)
        g = torch.Generator().manual_seed(1234 + rank)
        times, losses = [], []
        for step in range(steps):
            idx = torch.randint(0, len(ys), (batch,), generator=g)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(xs[idx]), ys[idx])
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.detach())
        with torch.no_grad():
            train_loss = nn.functional.cross_entropy(model(xtr), ytr).item()
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        nparam = sum(p.numel() for p in model.parameters())
        dense_bytes = 2 * (world - 1) * nparam * 4 // world
        wire = state.wire_bytes_per_step() if state is not None else dense_bytes
        rows.append({"hook": spec if state is None else state.compressor.spec()
                     + ("" if not state.error_feedback else " + EF"),
                     "algorithm": "allreduce" if state is None else _algorithms(state),
                     "train_loss": train_loss, "test_acc": acc, "wire_bytes": wire,
                     "dense_bytes": dense_bytes,
                     "step_ms": 1000 * statistics.median(times[5:]),
                     "plan": str(state.plan) if state is not None and state.algorithm == "auto" else "",
                     "params_hash": float(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum())})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--hooks", default=",".join(DEFAULT_HOOKS),
                    help="comma-separated 'dense' or compressor specs, each optionally @algorithm")
    args = ap.parse_args(argv)
    hooks = [h.strip() for h in args.hooks.replace(";", "|").split("|")] if ";" in args.hooks \
        else _split_specs(args.hooks)
    for h in hooks:  # bad specs fail here, before any rank starts
        if h != "dense":
            compressors.from_spec(h.partition("@")[0])
    t0 = time.time()
    results = spawn(run_rank, args.ranks, hooks, args.steps, args.batch, args.lr, timeout=600)
    print(f"digits MLP, {args.ranks} gloo ranks, {args.steps} steps, batch {args.batch}/rank "
          f"({time.time() - t0:.0f} s)\n")
    print(f"{'hook':<34} {'algorithm':<14} {'train loss':>10} {'test acc':>9} "
          f"{'wire B/step':>12} {'vs dense':>9} {'step ms':>8} {'replicas':>9}")
    for i, row in enumerate(results[0]):
        same = all(r[i]["params_hash"] == row["params_hash"] for r in results)
        print(f"{row['hook']:<34} {row['algorithm']:<14} {row['train_loss']:>10.4f} "
              f"{row['test_acc']:>9.3f} {row['wire_bytes']:>12,} "
              f"{row['dense_bytes'] / row['wire_bytes']:>8.1f}x {row['step_ms']:>8.2f} "
              f"{'equal' if same else 'DIFFER':>9}")
    for row in results[0]:
        if row["plan"]:
            print(f"\nauto's plan for {row['hook']} (rank 0):\n{row['plan']}")
    return 0


def _algorithms(state) -> str:
    """What the buckets actually used in the last step (auto may pick dense)."""
    used = sorted({s.algorithm for s in state.stats.values()})
    label = "+".join(used) if used else state.algorithm
    return f"auto:{label}" if state.algorithm == "auto" else label


def _split_specs(text: str) -> list[str]:
    """Split 'dense,topk:density=0.01,qsgd:bits=4' — commas inside a spec's options stay."""
    out: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if out and "=" in part and ":" not in part:
            out[-1] += "," + part  # an option of the previous spec
        elif part:
            out.append(part)
    return out


if __name__ == "__main__":
    sys.exit(main())
