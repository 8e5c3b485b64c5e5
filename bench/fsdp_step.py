"""FSDP2 / HSDP step time: plain FSDP2, torch's mixed-precision policies and comms.fsdp's
default and hand-picked settings, one run, rows interleaved step by step.

A small causal transformer (embedding, ``--depth`` encoder layers of width ``--width``, head;
each layer and the root ``fully_shard``-ed over all ranks), AdamW, the same batches for
every configuration. Every row is built once in one process group and the rows take turns
(one step of each per round), so ratios are within one run on the same machine state; two
floors are measured in the same run: ``local (no comm)`` — forward, backward and optimizer
step of the unsharded model on each rank with no collective at all — and the transfer floor
``raw_ms`` (each row's wire bytes at the link rate); dense FSDP2 runs twice (drift).

Rows: dense FSDP2; torch's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` and
``(reduce_dtype=bf16)``; ours as ``name[@algorithm][#params]`` — bare is the default path
(``comms.fsdp.register(model, name)``: ``algorithm`` and ``params`` ``"auto"``, decided per
module by measured calls during the warm-up), anything else is labelled as hand-picked.

**HSDP** (``--per-host K``, ``-n`` = hosts x K): ranks are placed host-major on netsim hosts
(``K`` ranks per host, their traffic inside a host unshaped loopback, between hosts the shaped
link) and the rows are: the no-comm floor; flat 1-D FSDP2 over every rank, dense and ours
(every collective crosses the slow link); torch's native HSDP on a ``(replicate=hosts,
shard=K)`` mesh, dense and with the mixed-precision policies; ours: 1-D FSDP over the host's
shard group plus our compressed all-reduce across the replicate group; native HSDP again
(drift). ``link_bytes``: what one rank sends over the slow link per step in the gradient sync
(HSDP rows); ``raw_ms`` there: ``K x link_bytes x 8 / rate``. ``outer [...]`` rows: ours with
the outer sync across the replicate group (``sync_every=H``: no gradient collective between
hosts on inner steps; :mod:`comms.outer`), hand-picked, their step the mean over the timed steps.

Usage::

    python bench/fsdp_step.py -n 2                                      # unshaped loopback
    python bench/fsdp_step.py -n 2 --netsim 1gbit --out bench/results/fsdp_step_1gbit
    python bench/fsdp_step.py -n 4 --per-host 2 --netsim 1gbit --out bench/results/fsdp_step_hsdp_1gbit
    python bench/fsdp_step.py -n 2 --profile sign --netsim 1gbit        # where one step's time goes

Wire bytes are what one rank sends per step: the gradient reduce-scatter plus the parameter
all-gathers (twice a step per module, once for the root, which FSDP2 keeps unsharded between
forward and backward).
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
import comms.transport.communicator
from comms.transport.futures import completed

__all__ = ["TinyLM", "rank_main", "main"]

# flat run: ours, "name[@algorithm][#params]"; bare = every default (algorithm and params "auto")
DEFAULT_SPECS = ("qsgd:bits=4,sign,topk:density=0.01,fp16,"
                 "qsgd:bits=4@scatter_reduce#full,sign@scatter_reduce#int8,sign@scatter_reduce#int4,identity#int8")
# HSDP run: ours on the replicate all-reduce
DEFAULT_HSDP_SPECS = "fp16,qsgd:bits=4,sign,topk:density=0.01,qsgd:bits=8@two_phase,sign@allgather"
# ... and on the flat 4-rank FSDP over every rank
DEFAULT_FLAT_SPECS = "qsgd:bits=4,sign"
# ... and the outer sync across the replicate group (every H steps; hand-picked): "spec@key=value,..."
DEFAULT_HSDP_OUTER = ("qsgd:bits=4@sync_every=4,sync_fragments=2,sync_delay=1",
                      "sign@sync_every=4,sync_fragments=2,sync_delay=1")
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


class LoopbackComm(comms.transport.communicator.Communicator):
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
    """``name[@algorithm][#params]`` -> (name, register kwargs); bare: every default."""
    spec, _, params = spec.partition("#")
    name, _, alg = spec.partition("@")
    kw = {}
    if alg:
        kw["algorithm"] = alg
    if params:
        kw["params"] = params
    return name, kw


def _split_outer(item: str):
    """``"spec@sync_every=16,sync_fragments=4,..."`` -> (spec, the outer sync's register keywords)."""
    from compressors.registry import _parse_value

    spec, _, kv = item.partition("@")
    return spec, {k.strip(): _parse_value(v) for k, _, v in (p.partition("=") for p in kv.split(",") if p)}


def _outer_label(spec: str, sync: dict) -> str:
    return f"{spec} outer [" + ", ".join(f"{k}={v}" for k, v in sync.items()) + "]"


def _label(spec: str) -> str:
    name, kw = _split(spec)
    if not kw:
        return f"{name} (default)"
    return f"{name} [" + ", ".join(f"{k}={v}" for k, v in kw.items()) + "]"


def _codec_ms(state, group, reps: int = 3) -> float:
    """Milliseconds per step of our reduce-scatter / all-reduce hooks' work with the transfers
    removed: every module's hook called on a fresh gradient of its size against
    :class:`LoopbackComm` (a copy of the state, so the trained one is untouched); median of
    ``reps`` steps. The parameter codec's time is measured in the run (``gather_stats``)."""
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


class Row:
    """One configuration, built once and stepped in turn with the others (interleaved: every
    row sees the same machine, round after round). ``mesh``: what the model is sharded over;
    ``spec``: ours (FSDP mode, or HSDP with ``replicate_group``); ``mp``: a
    MixedPrecisionPolicy; ``dense_link``: bytes one rank sends over the slow link per step
    when this row is a dense HSDP row (else from our stats)."""

    def __init__(self, name, args, rank, world, mesh, spec=None, local=False, replicate_group=None,
                 mp=None, dense_link=None, sync=None):
        self.name, self.args, self.rank, self.local = name, args, rank, local
        self.mesh, self.replicate_group, self.mp, self.dense_link = mesh, replicate_group, mp, dense_link
        self.model = _model(args, None if local else mesh, mp)
        self.state = None
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sync = sync  # the outer sync's keywords: the step is the mean over whole periods
        if spec:
            name_, kw = _split(spec)
            if sync:
                kw.update(sync, optimizer=self.opt)
            self.state = comms.fsdp.register(self.model, name_, replicate_group=replicate_group, **kw)
        self.times, self.loss, self.steps = [], None, 0
        self.world = world

    def step(self, timed: bool) -> None:
        x, y = _batch(self.rank, self.steps, self.args.batch)
        if not self.local:
            dist.barrier()
        t0 = time.perf_counter()
        self.opt.zero_grad()
        out = self.model(x)
        self.loss = nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
        self.loss.backward()
        self.opt.step()
        if timed:
            self.times.append(time.perf_counter() - t0)
        self.steps += 1
        if self.steps == self.args.warmup and self.state is not None:  # counters of the timed steps
            self.mark = {i: (g.wire_bytes, g.codec_s) for i, g in self.state.gather_stats.items()}

    def _dense_bytes(self) -> tuple[int, int]:
        """(gradient, parameter) bytes one rank sends per step in FSDP's own collectives:
        ``(W-1)/W`` of each module's padded size, the all-gather twice a step but for the root
        (FSDP2 keeps the root unsharded between forward and backward)."""
        from comms.fsdp import fsdp_modules

        w, grad, par = self.world, 0, 0
        pbytes = 2 if (self.mp is not None and self.mp.param_dtype is not None) else 4
        rbytes = 2 if (self.mp is not None and self.mp.reduce_dtype is not None) else 4
        for fqn, m in fsdp_modules(self.model):
            n = sum(fp._sharded_param_data.numel() for fp in m._get_fsdp_state()._fsdp_param_groups[0].fsdp_params) * w
            grad += (w - 1) * n * rbytes // w
            par += (w - 1) * n * pbytes // w * (1 if fqn == "" else 2)
        return grad, par

    def result(self) -> dict:
        # an outer-sync row sends at some steps only: its mean over the timed steps (whole periods)
        ms = torch.tensor([(statistics.fmean if self.sync else statistics.median)(self.times) * 1e3])
        if not self.local:
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the step is as slow as the slowest rank
        link, codec, gather_codec, params = self.dense_link, None, None, None
        n = len(self.times)
        if self.local:
            wire, res = 0, 0
        elif self.state is None:
            res = 0
            if self.mesh.ndim == 2:  # native HSDP: reduce-scatter in the shard group + replicate all-reduce
                wire = None
            else:
                grad, par = self._dense_bytes()
                wire, params = grad + par, par
        else:
            st = self.state
            outer = getattr(st, "outer", None)
            if outer is not None:  # one round of fragments every H steps, spread over its steps
                grad = outer.state.wire_bytes_per_step() // outer.schedule.every
            else:
                grad = sum(s.wire_bytes for s in st.stats.values())  # each module's last call: one a step
            par = sum(g.wire_bytes - self.mark.get(i, (0, 0))[0] for i, g in st.gather_stats.items()) // n
            gather_codec = sum(g.codec_s - self.mark.get(i, (0, 0))[1]
                               for i, g in st.gather_stats.items()) * 1e3 / n
            res = st.residual_bytes() if outer is None else outer.state.residual_bytes()
            if self.replicate_group is not None:
                link, wire = grad, grad
            else:
                if not st.gather_stats:
                    par = self._dense_bytes()[1]
                wire, params = grad + par, par
            if outer is None:  # the outer sync's codec runs inside its overlapped sends
                dist.barrier()
                group = self.replicate_group if self.replicate_group is not None else self.mesh.get_group()
                c = torch.tensor([_codec_ms(st, group) + (gather_codec or 0.0)])
                dist.all_reduce(c, op=dist.ReduceOp.MAX)
                codec = c.item()
        return {"config": self.name, "step_ms": ms.item(), "wire_bytes": wire, "param_bytes": params,
                "link_bytes": link, "codec_ms": codec, "ef_bytes": res, "loss": self.loss.item(),
                "decisions": None if self.state is None else _decisions(self.state)}


def _decisions(state) -> str | None:
    """``auto``'s per-module routes, short: ``g`` gradient compressed / ``d`` dense, then
    ``8`` int8 / ``f`` full parameters (``-``: not tuned)."""
    if getattr(state, "outer", None) is not None:
        return f"outer H{state.outer.schedule.every}"
    if state.tuner is None and state.gather_tuner is None:
        return None
    out = []
    for i in range(len(state.modules)):
        g = "-" if state.tuner is None else {"compressed": "g", "dense": "d"}.get(state.tuner.decision.get(i), "?")
        p = "-" if state.gather_tuner is None else {"compressed": "8", "dense": "f"}.get(
            state.gather_tuner.decision.get(i), "?")
        out.append(g + p)
    return " ".join(out)


def _run_rows(args, rows: list[Row]) -> list[dict]:
    """Warm-up then timed steps, one step of every row per round (the rows interleaved)."""
    for k in range(args.warmup + args.steps):
        for r in rows:
            r.step(timed=k >= args.warmup)
    return [r.result() for r in rows]


def _torch_mp():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"torch bf16 params+grads": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
            "torch bf16 grads": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)}


def _rows_flat(args, rank, world, mesh):
    specs = [s for s in args.specs.split(",") if s]
    rows = [Row("local (no comm) floor", args, rank, world, mesh, local=True),
            Row("dense FSDP2", args, rank, world, mesh)]
    rows += [Row(name, args, rank, world, mesh, mp=mp) for name, mp in _torch_mp().items()]
    rows += [Row(_label(s), args, rank, world, mesh, spec=s) for s in specs]
    rows.append(Row("dense FSDP2 (again)", args, rank, world, mesh))
    out = _run_rows(args, rows)
    return out, out[1]


def _rows_hsdp(args, rank, world):
    """host-major ranks; mesh (replicate=hosts, shard=per_host)."""
    from torch.distributed.device_mesh import init_device_mesh

    hosts, per_host = world // args.per_host, args.per_host
    flat = init_device_mesh("cpu", (world,))
    mesh = init_device_mesh("cpu", (hosts, per_host), mesh_dim_names=("replicate", "shard"))
    rg = mesh.get_group("replicate")
    # dense native HSDP: gloo's allreduce of this rank's gradient shard across the replicate group
    shard_numel = sum(p.to_local().numel() for p in _model(args, mesh["shard"]).parameters())
    dense_link = 2 * (hosts - 1) * shard_numel * 4 // hosts
    rows = [Row("local (no comm) floor", args, rank, world, flat, local=True),
            Row(f"flat FSDP2 {world} ranks dense", args, rank, world, flat)]
    rows += [Row(f"flat FSDP2 ours {_label(s)}", args, rank, world, flat, spec=s)
             for s in args.flat_specs.split(",") if s]
    rows += [Row("HSDP dense (torch native)", args, rank, world, mesh, dense_link=dense_link)]
    rows += [Row(f"HSDP {name}", args, rank, world, mesh, mp=mp, dense_link=dense_link // 2)
             for name, mp in _torch_mp().items()]
    rows += [Row(f"HSDP ours {_label(s)}", args, rank, world, mesh["shard"], spec=s, replicate_group=rg)
             for s in args.hsdp_specs.split(",") if s]
    for item in args.hsdp_outer:
        spec, sync = _split_outer(item)
        rows.append(Row(f"HSDP ours {_outer_label(spec, sync)}", args, rank, world, mesh["shard"], spec=spec,
                        replicate_group=rg, sync=sync))
    rows.append(Row("HSDP dense (again)", args, rank, world, mesh, dense_link=dense_link))
    out = _run_rows(args, rows)
    dense = next(r for r in out if r["config"] == "HSDP dense (torch native)")
    rate = _rate_bps(args.link)
    for r in out:  # the host's link carries its per_host ranks' bytes
        r["raw_ms"] = per_host * r["link_bytes"] * 8 / rate * 1e3 if (rate and r["link_bytes"]) else None
    return out, dense


def _rate_bps(link):
    import re

    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", (link or "").lower())
    if not m:
        return None
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _profile(args, rank, world, mesh):
    """Rank 0's torch.profiler table of ``--steps`` steps of dense FSDP2 and of ours."""
    from torch.profiler import ProfilerActivity, profile

    rows = [Row("dense FSDP2", args, rank, world, mesh), Row(_label(args.profile), args, rank, world, mesh,
                                                           spec=args.profile)]
    for _ in range(args.warmup):
        for r in rows:
            r.step(timed=False)
    for r in rows:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                r.step(timed=True)
        if rank == 0:
            print(f"## {r.name}: median step {statistics.median(r.times) * 1e3:.1f} ms; "
                  f"profiler totals over {args.steps} steps", flush=True)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.profile_rows), flush=True)
            if r.state is not None:
                print(r.state.report(), flush=True)
    return None


def rank_main(rank: int, world: int, args):
    from torch.distributed.device_mesh import init_device_mesh

    if args.profile:
        return _profile(args, rank, world, init_device_mesh("cpu", (world,)))
    if args.per_host > 1:
        rows, dense = _rows_hsdp(args, rank, world)
    else:
        rows, dense = _rows_flat(args, rank, world, init_device_mesh("cpu", (world,)))
    floor = rows[0]["step_ms"]
    rate = _rate_bps(args.link)
    for r in rows:
        r["speedup"] = dense["step_ms"] / r["step_ms"]
        r["x_floor"] = r["step_ms"] / floor
        if args.per_host == 1:
            r["raw_ms"] = r["wire_bytes"] * 8 / rate * 1e3 if (rate and r["wire_bytes"]) else None
    if rank != 0:
        return None
    cols = ["config", "step_ms", "speedup", "x_floor", "wire_bytes", "param_bytes", "raw_ms", "codec_ms",
            "ef_bytes", "loss", "decisions"]
    if args.per_host > 1:
        cols = ["config", "step_ms", "speedup", "x_floor", "link_bytes", "raw_ms", "codec_ms", "wire_bytes",
                "ef_bytes", "loss", "decisions"]
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
              "steps (`outer [...]` rows: the mean, as they send on some steps only; give a "
              "multiple of sync_every), max over ranks, the rows interleaved step by step; speedup = the dense row's "
              "step_ms / this row's, x_floor = this row's / the no-comm floor's, in this run. "
              "`(default)`: `comms.fsdp.register(model, spec)` with every default (algorithm and "
              "params `auto`); `[...]`: hand-picked settings. wire_bytes: what one rank sends per "
              "step, gradients and parameter all-gathers (flat rows; HSDP ours: our replicate "
              "all-reduce), param_bytes the all-gathers' part; raw_ms: wire_bytes at the link rate "
              "(the transfer floor); codec_ms: our hooks' work per step with no transfer (the "
              "reduce-scatter's on a loopback communicator after the run, plus the parameter "
              "codec's encode/decode time measured in the run); decisions: `auto`'s per-module "
              "routes (g/d: gradient compressed/dense; 8/f: int8/full parameters); ef_bytes: "
              "error-feedback memory per rank.",
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
    p.add_argument("--warmup", type=int, default=25,
                   help="untimed steps (auto decides each module after its warm-up ramp and 10 calls)")
    p.add_argument("--profile", metavar="SPEC", default=None,
                   help="profile dense FSDP2 and ours SPEC (torch.profiler, rank 0): where a step's time goes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--specs", default=DEFAULT_SPECS, help="flat FSDP2 run (no --per-host): ours")
    p.add_argument("--per-host", type=int, default=1,
                   help="ranks per (netsim) host; > 1: the HSDP run (mesh replicate=hosts x shard=per-host)")
    p.add_argument("--hsdp-specs", default=DEFAULT_HSDP_SPECS, help="HSDP run: ours, 'spec@algorithm'")
    p.add_argument("--flat-specs", default=DEFAULT_FLAT_SPECS, help="HSDP run: ours on flat FSDP2")
    p.add_argument("--hsdp-outer", action="append", default=None, metavar="SPEC@KEY=VALUE,...",
                   help="HSDP run: ours with the outer sync across the replicate group, e.g. "
                        "'qsgd:bits=4@sync_every=16,sync_fragments=4,sync_delay=3' (repeatable; "
                        "default: qsgd:bits=4 and sign at H 4, 2 fragments, delay 1; 'none': no such row)")
    p.add_argument("--profile-rows", type=int, default=30, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--link", default=None, help=argparse.SUPPRESS)
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.hsdp_outer = [o for o in (args.hsdp_outer or DEFAULT_HSDP_OUTER) if o != "none"]
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
