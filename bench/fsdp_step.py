"""FSDP2 step time: plain FSDP2 against each compressed reduce-scatter (comms.fsdp), one run.

A small causal transformer (embedding, ``--depth`` encoder layers of width ``--width``, head;
each layer and the root ``fully_shard``-ed over all ranks), AdamW, the same batches for
every configuration. Every row is measured inside one process group, so ratios are within
one run; two floors are measured in the same run: ``local (no comm)`` — forward, backward and
optimizer step of the unsharded model on each rank with no collective at all — and dense
FSDP2 again at the end (drift of the shared cores).

Usage::

    python bench/fsdp_step.py -n 2                                      # unshaped loopback
    python bench/fsdp_step.py -n 2 --netsim 1gbit --out bench/results/fsdp_step_1gbit

Wire bytes are what one rank sends per step in the gradient reduce-scatter (dense FSDP2:
``(W-1)/W`` of the fp32 gradient; the parameter all-gathers are the same in every row and
not counted).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import harness  # noqa: F401,E402  (puts the repository root first on sys.path)
from harness import launching, machine, tables  # noqa: E402
import torch
import torch.distributed as dist
import torch.nn as nn

import comms

__all__ = ["TinyLM", "rank_main", "main"]

DEFAULT_SPECS = "fp16,bf16,qsgd:bits=4,sign,topk:density=0.01,randomk:density=0.01"
VOCAB, SEQ = 128, 64


class TinyLM(nn.Module):
    """Character-level causal transformer (the shape of bench/convergence.py's charlm)."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0,
                                                               batch_first=True) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h, src_mask=self.mask, is_causal=True)
        return self.head(h)


def _batch(rank: int, step: int, batch: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _model(args, mesh=None):
    torch.manual_seed(args.seed)
    model = TinyLM(args.width, args.depth)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _measure(name, args, rank, world, mesh, spec=None, local=False):
    model = _model(args, None if local else mesh)
    state = comms.fsdp.register(model, spec, start_iter=0) if spec else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, loss = [], None
    for step in range(args.warmup + args.steps):
        x, y = _batch(rank, step, args.batch)
        if not local:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    ms = torch.tensor([statistics.median(times) * 1e3])
    if not local:
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the step is as slow as the slowest rank
    numel = sum(p.numel() for p in model.parameters())
    if spec:
        wire = sum(s.wire_bytes for s in state.stats.values())
        res = state.residual_bytes()
    else:
        wire = 0 if local else (world - 1) * numel * 4 // world
        res = 0
    return {"config": name, "step_ms": ms.item(), "wire_bytes": wire, "ef_bytes": res,
            "loss": loss.item()}


def rank_main(rank: int, world: int, args):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    specs = [s for s in args.specs.split(",") if s]
    rows = [_measure("local (no comm) floor", args, rank, world, mesh, local=True),
            _measure("dense FSDP2", args, rank, world, mesh)]
    rows += [_measure(s, args, rank, world, mesh, spec=s) for s in specs]
    rows.append(_measure("dense FSDP2 (again)", args, rank, world, mesh))
    dense = rows[1]
    for r in rows:
        r["speedup"] = dense["step_ms"] / r["step_ms"]
        r["wire_ratio"] = dense["wire_bytes"] / r["wire_bytes"] if r["wire_bytes"] else None
    if rank != 0:
        return None
    cols = ["config", "step_ms", "speedup", "wire_bytes", "wire_ratio", "ef_bytes", "loss"]
    print(tables.format_table(rows, cols), flush=True)
    if args.out:
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        numel = sum(p.numel() for p in _model(args).parameters())
        md = [f"# FSDP2 step time: tiny causal transformer, {world} ranks, link {args.link}", "",
              "```", args.command, "```", "",
              f"Machine: {machine.machine_facts()}. Load at the end of the run: `{load}`.",
              f"Model {numel} parameters (width {args.width}, depth {args.depth}), batch {args.batch} x "
              f"{SEQ} tokens per rank, AdamW; median of {args.steps} steps after {args.warmup} warm-up "
              "steps, max over ranks. wire_bytes: what one rank sends per step in the gradient "
              "reduce-scatter; ef_bytes: error-feedback memory per rank.", "",
              tables.format_table(rows, cols, markdown=True), ""]
        tables.write_text(args.out + ".md", "\n".join(md) + "\n")
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    launching.add_launch_args(p)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--specs", default=DEFAULT_SPECS)
    p.add_argument("--out", default=None)
    p.add_argument("--link", default=None, help=argparse.SUPPRESS)
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return launching.launch_recorded(os.path.abspath(__file__), rank_main, args, argv)


if __name__ == "__main__":
    main()
