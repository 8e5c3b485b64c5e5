"""FSDP2 / HSDP step time: plain FSDP2 (and torch's native HSDP) against each compressed
reduce-scatter / replicate all-reduce of comms.fsdp, one run.

A small causal transformer (embedding, ``--depth`` encoder layers of width ``--width``, head;
each layer and the root ``fully_shard``-ed over all ranks), AdamW, the same batches for
every configuration. Every row is measured inside one process group, so ratios are within
one run; two floors are measured in the same run: ``local (no comm)`` — forward, backward and
optimizer step of the unsharded model on each rank with no collective at all — and dense
FSDP2 again at the end (drift of the shared cores).

**HSDP** (``--per-host K``, ``-n`` = hosts x K): ranks are placed host-major on netsim hosts
(``K`` ranks per host, their traffic inside a host unshaped loopback, between hosts the shaped
link) and the rows are: the no-comm floor; flat 1-D FSDP2 over every rank, dense and with our
compressed reduce-scatter (every collective crosses the slow link); torch's native HSDP on a
``(replicate=hosts, shard=K)`` mesh, dense and with ``MixedPrecisionPolicy(reduce_dtype=bf16)``
(torch's own compressed gradient reduction: FSDP2 has no DDP comm hooks, and torch's PowerSGD
does not apply); ours: 1-D FSDP over the host's shard group plus our compressed all-reduce
across the replicate group; native HSDP again (drift). Extra columns: ``link_bytes``, what one
rank sends over the slow link per step in the gradient sync (HSDP rows); ``raw_ms``, the time
the host's link needs for its ranks' ``link_bytes`` at the link rate (``K x link_bytes x 8 /
rate``: the transfer floor); ``codec_ms``, our hooks' whole work per step run against a
loopback communicator (no transfer: compression, decoding, sums, error feedback), measured on
every rank at once after the timed steps, max over ranks.

Usage::

    python bench/fsdp_step.py -n 2                                      # unshaped loopback
    python bench/fsdp_step.py -n 2 --netsim 1gbit --out bench/results/fsdp_step_1gbit
    python bench/fsdp_step.py -n 4 --per-host 2 --netsim 1gbit --out bench/results/fsdp_step_hsdp_1gbit

Wire bytes are what one rank sends per step in the gradient reduce-scatter (dense FSDP2:
``(W-1)/W`` of the fp32 gradient; the parameter all-gathers are the same in every row and
not counted).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

import harness  # noqa: F401,E402  (puts the repository root first on sys.path)
from harness import launching, machine, tables  # noqa: E402
from harness.netsim import NetsimRank, rendezvous_port, run_on_hosts  # noqa: E402
import torch
import torch.distributed as dist
import torch.nn as nn

import comms
import comms.communicator
from comms.futures import completed

__all__ = ["TinyLM", "rank_main", "main"]

DEFAULT_SPECS = "fp16,bf16,qsgd:bits=4,sign,topk:density=0.01,randomk:density=0.01"
# HSDP run: ours on the replicate all-reduce ("spec@algorithm"; no algorithm: the state's default)
DEFAULT_HSDP_SPECS = ("identity,fp16,bf16,qsgd:bits=8,qsgd:bits=4,qsgd:bits=8@two_phase,sign,"
                      "topk:density=0.01,randomk:density=0.01")
# ... and on the flat 4-rank FSDP reduce-scatter
DEFAULT_FLAT_SPECS = "fp16,qsgd:bits=4,sign,topk:density=0.01"
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


def _model(args, mesh=None, mp=None):
    torch.manual_seed(args.seed)
    model = TinyLM(args.width, args.depth)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
        for layer in model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
    return model


class LoopbackComm(comms.communicator.Communicator):
    """A ``world``-rank communicator that moves nothing (every peer "sent" what this rank
    sent): our hooks run their whole codec path at full size, with no transfer."""

    backend = "loopback"

    def __init__(self, world: int, rank: int):
        self.world_size, self.rank = world, rank

    def all_reduce(self, t):
        return completed(t)

    def all_gather(self, t):
        return completed(t.reshape(-1).repeat(self.world_size))

    def all_to_all(self, t):
        return completed(t.clone())

    def reduce_scatter(self, t):
        return completed(t.view(self.world_size, -1)[self.rank].clone())

    def broadcast(self, t, src=0):
        return completed(t)


def _split(spec: str):
    name, _, alg = spec.partition("@")
    return name, (alg or None)


def _codec_ms(state, group, reps: int = 3) -> float:
    """Milliseconds per step of our hooks' work with the transfers removed: every module's
    hook called on a fresh gradient of its size against :class:`LoopbackComm` (a copy of the
    state, so the trained one is untouched); median of ``reps`` steps."""
    import copy

    from comms.fsdp import CompressedReduceScatter, ReplicateAllReduce

    st = copy.deepcopy(state)
    st.replicate_group = state.replicate_group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    st._comms = {id(group): LoopbackComm(world, rank)}
    st.config_check.passed.update(state.config_check.passed)
    g = torch.Generator().manual_seed(rank)
    xs = {i: torch.randn(s.numel, generator=g) * 1e-3 for i, s in state.stats.items()}
    times = []
    for _ in range(reps + 1):
        ins = {i: x.clone() for i, x in xs.items()}  # the hooks write into their input: fresh ones,
        outs = {i: torch.empty(x.numel() // world) for i, x in xs.items()}  # made outside the timing
        t0 = time.perf_counter()
        for i, x in ins.items():
            if st.mode == "fsdp":
                CompressedReduceScatter(st, i)(outs[i], x, group, dist.ReduceOp.SUM)
            else:
                ReplicateAllReduce(st, i)(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _measure(name, args, rank, world, mesh, spec=None, local=False, replicate_group=None, mp=None,
             dense_link=None):
    """One row. ``mesh``: what the model is sharded over; ``spec``: ours (FSDP mode, or HSDP
    with ``replicate_group``); ``mp``: a MixedPrecisionPolicy; ``dense_link``: bytes one rank
    sends over the slow link per step when this row is a dense HSDP row (else from our stats)."""
    model = _model(args, None if local else mesh, mp)
    state = None
    if spec:
        name_, alg = _split(spec)
        state = comms.fsdp.register(model, name_, start_iter=0, replicate_group=replicate_group,
                                    algorithm=alg)
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
    link = dense_link
    codec = None
    if spec:
        wire = sum(s.wire_bytes for s in state.stats.values())
        res = state.residual_bytes()
        if replicate_group is not None:
            link = wire
        dist.barrier()
        group = replicate_group if replicate_group is not None else mesh.get_group()
        c = torch.tensor([_codec_ms(state, group)])
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
        codec = c.item()
    else:
        if local:
            wire = 0
        elif mesh.ndim == 2:  # native HSDP: reduce-scatter in the shard group + replicate all-reduce
            wire = None
        else:
            wire = (world - 1) * numel * (2 if mp is not None else 4) // world
        res = 0
    return {"config": name, "step_ms": ms.item(), "wire_bytes": wire, "link_bytes": link,
            "codec_ms": codec, "ef_bytes": res, "loss": loss.item()}


def _rows_flat(args, rank, world, mesh):
    specs = [s for s in args.specs.split(",") if s]
    rows = [_measure("local (no comm) floor", args, rank, world, mesh, local=True),
            _measure("dense FSDP2", args, rank, world, mesh)]
    rows += [_measure(s, args, rank, world, mesh, spec=s) for s in specs]
    rows.append(_measure("dense FSDP2 (again)", args, rank, world, mesh))
    return rows, rows[1]


def _rows_hsdp(args, rank, world):
    """host-major ranks; mesh (replicate=hosts, shard=per_host)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    hosts, per_host = world // args.per_host, args.per_host
    flat = init_device_mesh("cpu", (world,))
    mesh = init_device_mesh("cpu", (hosts, per_host), mesh_dim_names=("replicate", "shard"))
    rg = mesh.get_group("replicate")
    # dense native HSDP: gloo's allreduce of this rank's gradient shard across the replicate group
    shard_numel = sum(p.to_local().numel() for p in _model(args, mesh["shard"]).parameters())
    dense_link = 2 * (hosts - 1) * shard_numel * 4 // hosts
    rows = [_measure("local (no comm) floor", args, rank, world, flat, local=True),
            _measure(f"flat FSDP2 {world} ranks dense", args, rank, world, flat)]
    rows += [_measure(f"flat FSDP2 ours {s}", args, rank, world, flat, spec=s)
             for s in args.flat_specs.split(",") if s]
    rows += [_measure("HSDP dense (torch native)", args, rank, world, mesh, dense_link=dense_link),
             _measure("HSDP torch reduce_dtype=bf16", args, rank, world, mesh,
                      mp=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16), dense_link=dense_link // 2)]
    dense = rows[-2]
    rows += [_measure(f"HSDP ours {s}", args, rank, world, mesh["shard"], spec=s, replicate_group=rg)
             for s in args.hsdp_specs.split(",") if s]
    rows.append(_measure("HSDP dense (again)", args, rank, world, mesh, dense_link=dense_link))
    rate = _rate_bps(args.link)
    for r in rows:  # the host's link carries its per_host ranks' bytes
        r["raw_ms"] = per_host * r["link_bytes"] * 8 / rate * 1e3 if (rate and r["link_bytes"]) else None
    return rows, dense


def _rate_bps(link):
    import re

    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", (link or "").lower())
    if not m:
        return None
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def rank_main(rank: int, world: int, args):
    from torch.distributed.device_mesh import init_device_mesh

    if args.per_host > 1:
        rows, dense = _rows_hsdp(args, rank, world)
    else:
        rows, dense = _rows_flat(args, rank, world, init_device_mesh("cpu", (world,)))
    for r in rows:
        r["speedup"] = dense["step_ms"] / r["step_ms"]
        r["wire_ratio"] = dense["wire_bytes"] / r["wire_bytes"] if (r["wire_bytes"] and dense["wire_bytes"]) else None
    if rank != 0:
        return None
    cols = ["config", "step_ms", "speedup", "wire_bytes", "wire_ratio", "ef_bytes", "loss"]
    if args.per_host > 1:
        cols = ["config", "step_ms", "speedup", "link_bytes", "raw_ms", "codec_ms", "wire_bytes",
                "ef_bytes", "loss"]
    elif any(r["codec_ms"] is not None for r in rows):
        cols.insert(5, "codec_ms")
    print(tables.format_table(rows, cols), flush=True)
    if args.out:
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        numel = sum(p.numel() for p in _model(args).parameters())
        layout = (f"{world // args.per_host} netsim hosts x {args.per_host} ranks" if args.per_host > 1
                  else f"{world} ranks")
        md = [f"# FSDP2 step time: tiny causal transformer, {layout}, link {args.link}", "",
              "```", args.command, "```", "",
              f"Machine: {machine.machine_facts()}. Load at the end of the run: `{load}`.",
              f"Model {numel} parameters (width {args.width}, depth {args.depth}), batch {args.batch} x "
              f"{SEQ} tokens per rank, AdamW; median of {args.steps} steps after {args.warmup} warm-up "
              "steps, max over ranks; speedup = the dense row's step_ms / this row's, in this run. "
              "wire_bytes: what one rank sends per step in the gradient reduce-scatter (flat rows) "
              "or in our replicate all-reduce (HSDP ours); ef_bytes: error-feedback memory per rank.",
              "", tables.format_table(rows, cols, markdown=True), ""]
        tables.write_text(args.out + ".md", "\n".join(md) + "\n")
    return rows


def _netsim_hosts(args, argv) -> int:
    """``-n`` ranks on ``-n / --per-host`` netsim hosts, host-major (bench/hierarchy.py's layout)."""
    world, per_host = args.nprocs, args.per_host
    if world % per_host:
        raise SystemExit(f"-n {world} is not a multiple of --per-host {per_host}")
    port = rendezvous_port()
    rest = launching.strip_flags(argv, {"--netsim": 1, "-n": 1, "--nprocs": 1})
    ranks = [NetsimRank(r // per_host, [sys.executable, os.path.abspath(__file__), "--rank", str(r),
                                        "--world", str(world), "--master-port", str(port), "--no-lock",
                                        *rest], stdout=None if r == 0 else subprocess.DEVNULL)
             for r in range(world)]
    run_on_hosts(world // per_host, args.netsim, ranks, args.timeout)
    return 0


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
    p.add_argument("--specs", default=DEFAULT_SPECS, help="flat FSDP2 run (no --per-host): ours")
    p.add_argument("--per-host", type=int, default=1,
                   help="ranks per (netsim) host; > 1: the HSDP run (mesh replicate=hosts x shard=per-host)")
    p.add_argument("--hsdp-specs", default=DEFAULT_HSDP_SPECS, help="HSDP run: ours, 'spec@algorithm'")
    p.add_argument("--flat-specs", default=DEFAULT_FLAT_SPECS, help="HSDP run: ours on flat FSDP2")
    p.add_argument("--out", default=None)
    p.add_argument("--link", default=None, help=argparse.SUPPRESS)
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.per_host > 1 and args.netsim and args.rank is None:
        from harness.locks import BENCH_LOCK, file_lock

        if args.command is None:
            args.command = launching.shell_command(argv)
            argv = [*argv, "--command", args.command]
        argv = [*argv, "--link", args.netsim]
        with file_lock(BENCH_LOCK, "(bench)") if not args.no_lock else contextlib.nullcontext():
            return _netsim_hosts(args, argv)
    return launching.launch_recorded(os.path.abspath(__file__), rank_main, args, argv)


if __name__ == "__main__":
    main()
