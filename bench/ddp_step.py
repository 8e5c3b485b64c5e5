"""DDP step time of every gradient hook, in one run: dense allreduce, PyTorch's
``fp16_compress_hook`` and ``powerSGD_hook`` (rank 1 and 4), and commpress's hooks.

One process group; for each hook a fresh DDP wrapper of an identically initialised model is
trained on the same batches; the median step time (after warm-up steps that cover the hooks'
``start_iter``), the bytes each rank sends per step and the ratios to dense are printed.

    python bench/ddp_step.py -n 2                                 # self-spawn 2 gloo ranks
    python bench/ddp_step.py -n 2 --netsim 1gbit                  # root: shaped links (netsim)
    torchrun --nproc-per-node 2 bench/ddp_step.py                 # env init
    mpiexec -n 2 python bench/ddp_step.py                         # env init (MPI variables)
    python bench/ddp_step.py --model conv --hooks dense,qsgd8     # other model, some hooks

Models: ``mlp`` (6 x Linear(2048): 25.2M parameters), ``conv`` (a small conv net on 32x32
images), ``transformer`` (a small encoder language model). Batch 16 per rank by default.

.. warning::
    torch's ``powerSGD_hook`` fails on gloo when DDP makes more than one bucket, so it always
    gets a bucket cap large enough for the whole model. The default ``--bucket-cap-mb`` gives
    every other hook the same single bucket; with a smaller cap the ``buckets`` column shows
    the difference.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # for harness; last, so that
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/*.py never shadow packages
import harness  # noqa: E402  (puts the repository root first on sys.path)
from harness import hooks, launching, machine, tables, wire  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from comms.core.engine import DRAIN_STEPS as RESIDUAL_DRAIN_STEPS  # noqa: E402

__all__ = ["MODELS", "ResMLP", "StepRunner", "FloorRunner", "build_model", "interleaved_times", "make_batches",
           "set_one_bucket",
           "measure", "main"]

logger = logging.getLogger(__name__)

PROFILES: list = []  # (hook, step ms, profiler table) collected on rank 0 for the .md file
COLUMNS = ["hook", "algorithm", "buckets", "tuned", "step_ms", "p90_ms", "speedup", "vs_floor",
           "wire_MB", "wire_ratio", "raw_ms", "codec_ms"]
FLOOR = "no-comm floor"  # the row of the same model trained without DDP (world size 1)
MAX_TUNING_STEPS = 120  # auto rows warm up until the autotuner locks, at most this many steps


# -- models ---------------------------------------------------------------------------------
def _mlp(width: int = 2048, depth: int = 6) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ResMLP(nn.Module):
    """``depth`` Linear(width) layers as a pre-norm residual MLP with a ``classes``-way head:
    ``h = W0 x``, then ``h += W_i relu(LN_i(h))``, logits ``= head(LN(h))``. The same 25M
    weights as :func:`_mlp` at width 2048, depth 6 (plus the norms and a 10-way head), and well
    conditioned: plain ``_mlp`` with its 2048-way output spikes and stalls under SGD momentum
    (bench/convergence.py's time-to-quality task uses this one)."""

    def __init__(self, width: int = 2048, depth: int = 6, classes: int = 10):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth - 1))
        self.out_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    @property
    def in_features(self) -> int:
        return self.inp.in_features

    @property
    def out_features(self) -> int:
        return self.head.out_features

    def forward(self, x):
        h = self.inp(x)
        for norm, lin in zip(self.norms, self.blocks):
            h = h + lin(torch.relu(norm(h)))
        return self.head(self.out_norm(h))


def _conv(width: int = 64, depth: int = 3) -> nn.Module:
    layers: list[nn.Module] = []
    c_in = 3
    for i in range(depth):
        c = width * 2 ** i
        layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c_in = c
    side = 32 // 2 ** depth
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(c_in * side * side, 256), nn.ReLU(),
                         nn.Linear(256, 10))


class TinyLM(nn.Module):
    """A small pre-norm transformer encoder with a causal mask over byte tokens."""

    def __init__(self, width: int = 256, depth: int = 4, vocab: int = 256, seq: int = 64,
                 heads: int = 4):
        super().__init__()
        self.seq = seq
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


MODELS = {"mlp": _mlp, "resmlp": ResMLP, "conv": _conv, "transformer": TinyLM}


def build_model(name: str, width: int | None, depth: int | None, seed: int = 0) -> nn.Module:
    """The same initial weights on every rank and for every hook (seeded local generator)."""
    kw = {k: v for k, v in (("width", width), ("depth", depth)) if v is not None}
    torch.manual_seed(seed)  # nn.Module initialisers read the global RNG; reset it per build
    return MODELS[name](**kw)


def make_batches(name: str, model: nn.Module, batch: int, rank: int, count: int = 4, seed: int = 0):
    """``count`` fixed (input, target) batches for this rank; reused cyclically by every hook."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    out = []
    for _ in range(count):
        if name in ("mlp", "resmlp"):
            first, last = (model[0], model[-1]) if name == "mlp" else (model, model)
            x = torch.randn(batch, first.in_features, generator=g)
            y = torch.randint(0, last.out_features, (batch,), generator=g)
        elif name == "conv":
            x = torch.randn(batch, 3, 32, 32, generator=g)
            y = torch.randint(0, 10, (batch,), generator=g)
        else:
            toks = torch.randint(0, model.head.out_features, (batch, model.seq + 1), generator=g)
            x, y = toks[:, :-1], toks[:, 1:]
        out.append((x, y))
    return out


def _loss(out, y):
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# -- measuring ------------------------------------------------------------------------------
def _codec_ms(cfg, numel: int, reps: int = 3) -> float | None:
    """Median ms of compress + decompress of one ``numel`` bucket (None where not separable)."""
    if cfg.kind != "ours":
        return None
    import compressors

    try:
        comp = compressors.from_spec(cfg.spec)
        x = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3
        ctx = compressors.Context(numel=numel, dtype=x.dtype, device=x.device, step=5, bucket=0,
                                  rank=dist.get_rank(), seed=0)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            comp.decompress(comp.compress(x, ctx), ctx)
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)
    except (NotImplementedError, AttributeError, TypeError, ValueError):
        return None


class StepRunner:
    """One hook configuration's training run, a step at a time: the model, DDP, SGD and the
    hook, built once; :meth:`step` times one step (after a barrier, so every rank starts it
    together). :func:`measure` runs one to the end; ``bench/autotune.py`` interleaves several
    (their steps alternate, so the machine's drift falls on all of them alike)."""

    def __init__(self, cfg, args, rank: int, world: int, pairing: str | None = None):
        self.cfg, self.args, self.rank, self.world = cfg, args, rank, world
        self.model = build_model(args.model, args.width, args.depth, args.seed)
        self.batches = make_batches(args.model, self.model, args.batch, rank, seed=args.seed)
        cap = args.bucket_cap_mb
        if cfg.kind == "torch-powersgd":  # torch's powerSGD_hook fails on gloo with > 1 bucket
            cap = max(cap, args.one_bucket_mb)
        self.ddp = DDP(self.model, bucket_cap_mb=cap)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=1e-3, momentum=0.9)
        # our hooks take SGD's momentum over (momentum correction): the default way
        pairing = pairing or getattr(args, "pairing", "optimizer")
        extra = getattr(args, "auto_hook_kwargs", {}) if cfg.algorithm == "auto" else {}
        self.state = hooks.attach_hook(self.ddp, cfg, start_iter=args.start_iter,
                                       optimizer=self.opt if pairing == "optimizer" else None, **extra)
        self.tuner = getattr(getattr(self.state, "planner", None), "tuner", None)
        self.i = 0
        self.loss = torch.zeros(())

    def step(self, profile: bool = False) -> float:
        """One training step; its wall-clock seconds on this rank."""
        x, y = self.batches[self.i % len(self.batches)]
        dist.barrier()
        prof = None
        if profile:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=False)
        self.loss = _loss(self.ddp(x), y)
        self.loss.backward()
        self.opt.step()
        dt = time.perf_counter() - t0
        if prof is not None:
            prof.__exit__(None, None, None)
            if self.rank == 0:
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
                PROFILES.append((self.cfg.name, 1e3 * dt, table))
                print(f"# profile of one step of {self.cfg.name} (rank 0, self CPU time):\n{table}")
        self.i += 1
        return dt

    def warm_up(self) -> None:
        """``args.warmup`` steps (at least ``start_iter + 2``: the first compressed steps
        allocate buffers), then, for ``algorithm="auto"``, until the autotuner locked (at most
        MAX_TUNING_STEPS more): what follows is the steady state. Every rank sees the same
        ``locked`` (the decision is one agreed collective)."""
        warmup = max(self.args.warmup, self.args.start_iter + 2)
        while self.i < warmup:
            self.step()
        extra = 0
        while self.tuner is not None and not self.tuner.locked and extra < MAX_TUNING_STEPS:
            self.step()
            extra += 1
        # a dense lock adds the trials' error-feedback residuals back over the next
        # RESIDUAL_DRAIN_STEPS steps (a pass over the bucket each): the end of tuning, not the
        # steady state (the drain starts at the first locked step; every rank drains alike)
        if self.tuner is not None and self.tuner.locked and self.state.memory.residuals:
            self.step()
            drained = 1
            while self.state.memory.draining and drained <= RESIDUAL_DRAIN_STEPS:
                self.step()
                drained += 1

    def tunings(self) -> int:
        """Trial phases the autotuner ran so far (0 without one)."""
        return getattr(self.tuner, "tunings", 0) if self.tuner is not None else 0

    def row(self, times: list[float]) -> dict:
        """The row of these measured steps (seconds on this rank; the max over ranks is taken
        here: a step is as slow as its slowest rank). Collective: every rank calls it."""
        args, world, cfg, tuner = self.args, self.world, self.cfg, self.tuner
        step_ms, p90_ms, per_step = _max_over_ranks_ms(times)
        if getattr(self.state, "outer", None) is not None:  # sends on some steps only: the mean
            step_ms = statistics.fmean(per_step)
        params = [p for p in self.model.parameters() if p.requires_grad]
        wire_b = wire.config_wire_bytes(cfg, self.state, params, world)
        sizes = str(self.ddp._get_ddp_logging_data().get("bucket_sizes", ""))
        numel = sum(p.numel() for p in params)
        row = {"hook": cfg.name,
               "algorithm": wire.config_algorithm(cfg, self.state, wire.dense_wire_bytes(numel, world)),
               "buckets": len([b for b in sizes.split(",") if b.strip()]) or None,
               "tuned": (f"{tuner.tuning_steps}" + ("" if tuner.locked else " (not locked)"))
               if tuner is not None else None,
               "step_ms": step_ms, "p90_ms": p90_ms, "times_ms": per_step,
               "wire_bytes": wire_b, "wire_MB": wire_b / 1e6 if wire_b else None,
               "loss": float(self.loss.detach())}
        if args.codec:
            row["codec_ms"] = _codec_ms(cfg, numel)
        row["raw_ms"] = raw_transfer_ms(wire_b, world)
        return row

    def close(self) -> None:
        del self.ddp, self.opt, self.state, self.model


class FloorRunner(StepRunner):
    """The no-communication floor as a :class:`StepRunner`: the same model and batches trained
    without DDP on every rank at once (world size 1, no communication, the cores shared as in
    the DDP rows)."""

    def __init__(self, args, rank: int, world: int):
        self.cfg, self.args, self.rank, self.world = None, args, rank, world
        self.model = build_model(args.model, args.width, args.depth, args.seed)
        self.batches = make_batches(args.model, self.model, args.batch, rank, seed=args.seed)
        self.ddp = self.model  # trained as it is: no DDP, no hook
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.state = self.tuner = None
        self.i = 0
        self.loss = torch.zeros(())

    def warm_up(self) -> None:
        """``args.warmup`` steps (no hook: nothing to allocate or tune)."""
        while self.i < self.args.warmup:
            self.step()

    def row(self, times: list[float]) -> dict:
        step_ms, p90_ms, per_step = _max_over_ranks_ms(times)
        return {"hook": FLOOR, "algorithm": "none", "step_ms": step_ms, "p90_ms": p90_ms, "times_ms": per_step,
                "wire_bytes": None, "wire_MB": None}


def _max_over_ranks_ms(times: list[float]) -> tuple[float, float, list[float]]:
    """Median and p90 step (ms) of the per-step max over ranks, and those per-step maxima (ms,
    in step order: ``--json`` keeps them) (collective)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    per_step = [1e3 * v for v in t.tolist()]
    ts = sorted(per_step)
    return statistics.median(ts), ts[min(len(ts) - 1, math.ceil(0.9 * len(ts)) - 1)], per_step


def interleaved_times(runners: list, steps: int, block: int) -> list[list[float]]:
    """Warmed-up runners take turns in blocks of ``block`` steps (order reversed every other
    block) until each has ``steps`` counted steps; the first step of every block is not
    counted, for every runner alike (it meets caches the others just used). A load change on
    the shared machine then falls on every runner instead of on whichever ran during it.
    Returns each runner's counted step seconds (this rank's)."""
    times: list[list[float]] = [[] for _ in runners]
    block = max(2, block)
    b = 0
    while min(len(t) for t in times) < steps:
        order = range(len(runners)) if b % 2 == 0 else reversed(range(len(runners)))
        for k in order:
            for j in range(block):
                dt = runners[k].step()
                if j > 0 and len(times[k]) < steps:
                    times[k].append(dt)
        b += 1
    return times


def measure(cfg, args, rank: int, world: int, profile: bool = False,
            pairing: str | None = None) -> dict:
    """Train ``cfg`` for warm-up + measured steps; the step times are the max over ranks.
    ``pairing`` (default ``args.pairing``): ``"optimizer"`` gives our hooks the optimizer."""
    run = StepRunner(cfg, args, rank, world, pairing)
    run.warm_up()
    times = [run.step(profile=profile and k == 0) for k in range(args.steps)]
    row = run.row(times)
    run.close()
    return row


def raw_transfer_ms(wire_bytes: int | None, world: int, reps: int = 3) -> float | None:
    """Median ms of one plain gloo allreduce that makes each rank send ``wire_bytes`` (a ring
    allreduce of B bytes sends 2(n-1)/n B per rank): the wire-time floor of a row's bytes,
    measured on the same links in the same run."""
    if not wire_bytes or world < 2:
        return None
    numel = max(1, wire_bytes * world // (2 * (world - 1)) // 4)
    buf = torch.zeros(numel)
    dist.all_reduce(buf)  # warm-up: connections and buffers
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        ts.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(ts)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return 1e3 * float(t)


def measure_floor(args, rank: int, world: int) -> dict:
    """The no-communication floor row (:class:`FloorRunner`): the step no hook can beat."""
    run = FloorRunner(args, rank, world)
    run.warm_up()
    row = run.row([run.step() for _ in range(args.steps)])
    run.close()
    return row


def measure_pairing(cfg, args, rank: int, world: int) -> list[dict]:
    """The cost of handing the optimizer to the hook (momentum correction, masking):
    ``args.pairing_rounds`` interleaved pairs (paired, unpaired, paired, ...), each a fresh
    :func:`measure`; one row each, named ``cfg.name [optimizer]`` / ``[none]`` (the median over
    rounds), the first with ``pair_ratio``: the median over rounds of paired step / unpaired
    step (a ratio inside each adjacent pair, so the machine's drift between rounds cancels)."""
    got = {"optimizer": [], "none": []}
    for _ in range(args.pairing_rounds):
        for pairing in ("optimizer", "none"):
            got[pairing].append(measure(cfg, args, rank, world, pairing=pairing))
    rows = []
    for pairing, runs in got.items():
        row = dict(runs[0])
        row["step_ms"] = statistics.median(r["step_ms"] for r in runs)
        row["p90_ms"] = statistics.median(r["p90_ms"] for r in runs)
        row["hook"] = f"{cfg.name} [{pairing}]"
        rows.append(row)
    ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(got["optimizer"], got["none"])]
    ratio = statistics.median(ratios)
    rows[0]["pair_ratio"] = ratio
    if rank == 0:
        each = ", ".join(f"{a['step_ms']:.0f}/{b['step_ms']:.0f}"
                         for a, b in zip(got["optimizer"], got["none"]))
        print(f"# pairing cost {cfg.name}: optimizer/none per round median {ratio:.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}); medians {rows[0]['step_ms']:.1f}/"
              f"{rows[1]['step_ms']:.1f} ms (rounds, ms: {each})", flush=True)
    return rows


def _one_bucket_mb(args) -> float:
    m = build_model(args.model, args.width, args.depth, args.seed)
    return sum(p.numel() * p.element_size() for p in m.parameters()) / 2 ** 20


def set_one_bucket(args) -> float:
    """``args.one_bucket_mb``: a DDP bucket cap that holds the whole model (torch PowerSGD's
    rows always get it), and ``args.bucket_cap_mb`` defaulted to it. Returns the model's MB."""
    model_mb = _one_bucket_mb(args)
    args.one_bucket_mb = math.ceil(model_mb * 1.1) + 1
    if args.bucket_cap_mb is None:
        args.bucket_cap_mb = args.one_bucket_mb
    return model_mb


def rank_main(rank: int, world: int, args) -> list[dict] | None:
    configs, skipped = hooks.hook_configs()
    configs = hooks.filter_configs(configs, args.hooks)
    model_mb = set_one_bucket(args)
    numel = sum(p.numel() for p in build_model(args.model, args.width, args.depth).parameters())
    if rank == 0:
        print(f"# ddp_step: model={args.model} params={numel} ({model_mb:.1f} MB fp32) world={world} "
              f"batch={args.batch}/rank bucket_cap_mb={args.bucket_cap_mb} warmup="
              f"{max(args.warmup, args.start_iter + 2)} steps={args.steps} threads/rank="
              f"{torch.get_num_threads()} link={args.link}", flush=True)
        for what, why in skipped:
            print(f"# skipped {what}: {why}", flush=True)
    rows = []
    profiled = set((args.profile or "").split(","))
    if args.interleave:  # every row built at once, their steps interleaved (one set of load)
        runners = [StepRunner(cfg, args, rank, world) for cfg in configs]
        runners += [FloorRunner(args, rank, world)] if args.floor else []
        for run in runners:
            run.warm_up()
        for run, ts in zip(runners, interleaved_times(runners, args.steps, args.interleave)):
            rows.append(run.row(ts))
        for run in runners:
            run.close()
    else:
        it = tables.progress(configs, total=len(configs), desc="hooks", enable=rank == 0 and args.progress)
        for cfg in it:
            if args.pairing == "both" and cfg.kind == "ours":
                rows += measure_pairing(cfg, args, rank, world)
            else:
                rows.append(measure(cfg, args, rank, world, profile=cfg.name in profiled))
        if args.repeat_dense and len(configs) > 1:  # drift check: the shared cores change load
            again = measure(configs[0], args, rank, world)
            again["hook"] = "dense(again)"
            rows.append(again)
        if args.floor:
            rows.append(measure_floor(args, rank, world))
    dense = next(r for r in rows if r["hook"] == "dense")
    floor = next((r for r in rows if r["hook"] == FLOOR), None)
    for r in rows:
        r["speedup"] = dense["step_ms"] / r["step_ms"]
        r["vs_floor"] = r["step_ms"] / floor["step_ms"] if floor else None
        r["wire_ratio"] = dense["wire_bytes"] / r["wire_bytes"] if r["wire_bytes"] else None
    if rank != 0:
        return None
    cols = COLUMNS if args.codec else [c for c in COLUMNS if c != "codec_ms"]
    if args.pairing == "both":
        cols = cols + ["pair_ratio"]
    print(tables.format_table(rows, cols), flush=True)
    meta = {"model": args.model, "params": numel, "world": world, "batch": args.batch,
            "bucket_cap_mb": args.bucket_cap_mb, "link": args.link, "steps": args.steps,
            "skipped": skipped, "machine": machine.machine_facts(), "command": args.command}
    if args.json:
        tables.write_text(args.json, json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.out:
        tables.write_csv(args.out + ".csv", rows, cols + ["wire_bytes"])
        md = [f"# DDP step time: {args.model}, {world} ranks, link {args.link}", "",
              "```", args.command, "```", "",
              f"Machine: {meta['machine']}. Model {numel} parameters, batch {args.batch} per rank, "
              f"bucket_cap_mb={args.bucket_cap_mb} (torch's powerSGD_hook always gets one bucket: it "
              f"fails on gloo with more), median of {args.steps} steps after warm-up (a row using the outer sync: the mean, "
              "as it sends on some steps only); step time is the max over "
              "ranks; wire bytes are what each rank sends per step (ring allreduce counts "
              "2(n-1)/n of the buffer).", "",
              "Rows `default(...)` are `comms.register(ddp, spec)` with every default "
              "(algorithm auto: measured after the autotuner locked, `tuned` = its tuning "
              "steps); rows `name@algorithm` pin an algorithm or a setting (e.g. exact=false) "
              f"and are hand-picked. `{FLOOR}`: the same model trained without DDP on every "
              "rank at once (world size 1, no communication); `vs_floor` = step / that. "
              "`raw_ms`: one plain gloo allreduce that sends the row's wire bytes per rank, "
              "on the same links in the same run (the wire-time floor). `speedup` is dense "
              "step / row step."
              + (f" Rows measured **interleaved**: all built and warmed up, then blocks of "
                 f"{args.interleave} steps in turn (the first of each not counted) until each "
                 f"has {args.steps} counted steps: the ratios compare steps taken seconds apart."
                 if args.interleave else "")
              + (f" `[optimizer]`/`[none]`: the hook registered with / without the optimizer "
                 f"(SGD momentum in the hook: momentum correction and masking / in the "
                 f"optimizer), {args.pairing_rounds} interleaved pairs, each row the median; "
                 "`pair_ratio` = the median over rounds of optimizer / none inside each pair."
                 if args.pairing == "both" else ""), ""]
        md += [f"Skipped: {what} — {why}" for what, why in skipped] + [""]
        md.append(tables.format_table(rows, cols, markdown=True))
        for name, ms, table in PROFILES:
            md += ["", f"Profile of one measured step of `{name}` ({ms:.0f} ms under the profiler; "
                   "rank 0; self CPU time; the hook's wait for the collective shows as autograd "
                   "engine time):", "", "```", table.strip(), "```"]
        tables.write_text(args.out + ".md", "\n".join(md) + "\n")
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairing", choices=("optimizer", "none", "both"), default="optimizer",
                   help="our hooks: register(..., optimizer=opt) (SGD momentum moves into the "
                        "hook, the default) or without it (the optimizer keeps its momentum); "
                        "'both': --pairing-rounds interleaved pairs per hook and the cost ratio")
    p.add_argument("--pairing-rounds", type=int, default=3,
                   help="--pairing both: interleaved (optimizer, none) pairs per hook")
    launching.add_launch_args(p)
    p.add_argument("--model", choices=sorted(MODELS), default="mlp")
    p.add_argument("--width", type=int, default=None, help="model width (mlp 2048, conv 64, transformer 256)")
    p.add_argument("--depth", type=int, default=None, help="layers (mlp 6, conv 3, transformer 4)")
    p.add_argument("--batch", type=int, default=16, help="samples per rank")
    p.add_argument("--steps", type=int, default=8, help="measured steps per hook")
    p.add_argument("--warmup", type=int, default=4, help="warm-up steps (at least start_iter + 2)")
    p.add_argument("--start-iter", type=int, default=2, help="dense iterations before compressing")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP bucket cap (default: the whole model in one bucket); torch PowerSGD "
                        "always gets one bucket, as its hook fails on gloo with more")
    p.add_argument("--hooks", default=None,
                   help="comma-separated names (or substrings) of hooks to run; dense always runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-repeat-dense", dest="repeat_dense", action="store_false",
                   help="do not measure dense again at the end (the drift check)")
    p.add_argument("--interleave", type=int, default=0, metavar="B",
                   help="build every row at once and interleave their measured steps in blocks "
                        "of B (the first of each not counted); 0: one row after another")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help=f"skip the '{FLOOR}' row (the model trained without DDP on every rank)")
    p.add_argument("--no-codec", dest="codec", action="store_false",
                   help="skip the standalone compress+decompress timing column")
    p.add_argument("--profile", default=None, metavar="HOOK[,HOOK]",
                   help="print a torch.profiler table of one measured step of these hooks")
    p.add_argument("--out", default=None,
                   help="write OUT.md and OUT.csv (default bench/results/ddp_step_<link>, <link> the "
                        "--netsim rate or 'unshaped'; '' for none)")
    p.add_argument("--json", default=None, help="write the rows as JSON (used by sweep.py)")
    p.add_argument("--link", default=None, help=argparse.SUPPRESS)
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--list", action="store_true", help="list the hook configurations and exit")
    return p


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.list:
        configs, skipped = hooks.hook_configs()
        for c in configs:
            alg = c.algorithm or ("auto" if c.default or c.sync else "")
            sync = ",".join(f"{k}={v}" for k, v in c.sync)
            print(f"{c.name:32} {c.kind:15} {c.spec or ''} {alg} {sync}".rstrip())
        for what, why in skipped:
            print(f"# skipped {what}: {why}")
        return None
    if args.command is None:  # what the user typed, before the default below is made explicit
        args.command = launching.shell_command(argv)
        argv = [*argv, "--command", args.command]
    if args.out is None:
        args.out = os.path.join(harness.RESULTS, f"ddp_step_{args.netsim or 'unshaped'}")
        argv = [*argv, "--out", args.out]
    return launching.launch_recorded(os.path.abspath(__file__), rank_main, args, argv)


if __name__ == "__main__":
    main()
