"""FSDP2 / HSDP convergence: bench/convergence.py's char transformer trained with plain FSDP2
(or torch's native HSDP) and with each compressor through :mod:`comms.fsdp`, in one run.

* ``--mode fsdp`` (default ``-n 2``): every transformer layer and the root ``fully_shard``-ed
  over all ranks; dense = plain FSDP2; ours = :func:`comms.fsdp.register` (compressed
  reduce-scatter).
* ``--mode hsdp`` (``-n 4`` as 2 x 2): dense = torch's native HSDP on a
  ``(replicate, shard)`` mesh; ours = 1-D FSDP over ``mesh["shard"]`` plus our compressed
  all-reduce across ``mesh.get_group("replicate")``. At the end each rank's local shards are
  compared bitwise with its replicate peer's (``replicas`` column).

torch's own compressed gradient reduction for FSDP2 — ``MixedPrecisionPolicy(reduce_dtype=
torch.bfloat16)`` — runs next to them as ``torch-mp-bf16`` (FSDP2 has no DDP-style comm hooks;
torch PowerSGD does not apply to it). Same task, seeds, data order, AdamW and step count as
``bench/convergence.py --tasks charlm``; the final loss is the mean of the last ``--tail``
held-out evaluations and its ratio to dense is printed next to the targets (:data:`TARGETS`);
the ``ddp-*`` rows run the DDP path on the same model, the quality the FSDP/HSDP rows are held to.
``--unused-every 4`` adds a root parameter that gets no gradient one step in four.

    python bench/fsdp_convergence.py -n 2 --mode fsdp --out bench/results/fsdp_convergence_fsdp2
    python bench/fsdp_convergence.py -n 4 --mode hsdp --batch 8 --out bench/results/fsdp_convergence_hsdp4

Time to quality (``--netsim RATE``, root): a 3.3M-parameter char transformer (width 256, depth 4,
AdamW) on the shaped link; dense FSDP2 trains ``--steps`` steps, every other row (every default,
torch's policies beside) until dense's final loss or dense's wall time::

    python bench/fsdp_convergence.py -n 2 --netsim 1gbit --out bench/results/fsdp_time_to_quality_1gbit

Writes ``OUT.md``; with ``--plot`` also ``OUT.csv`` (final losses), ``OUT_curves.csv`` and the
plot ``OUT_charlm.png`` (``OUT.png`` for time to quality).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (puts the repository root first on sys.path)
from harness import launching, machine, tables  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import comms  # noqa: E402
import compressors  # noqa: E402
from convergence import (CharLM12MTask, CharLMTask, _final, _plot, _plot_ttq, _uptime, smoothed,  # noqa: E402
                         task_floor, time_to_quality)

__all__ = ["CONFIGS", "shard_charlm", "train", "main"]

# (row name, kind, spec): kind "dense" = plain FSDP2 / native HSDP, "torch-mp" = FSDP2's
# MixedPrecisionPolicy (spec "bf16": reduce_dtype; "bf16-params": param_dtype and reduce_dtype),
# "ours" = comms.fsdp.register with "name[@algorithm][#params]" (bench/fsdp_step.py's syntax).
# Equal-step rows pin the algorithm (on loopback auto rightly picks dense); HSDP drops the
# FSDP-only "@scatter_reduce" and "#int8" (its parameter all-gather stays inside a host)
CONFIGS = (  # the target rows first: a run cut short still reports them
    ("dense", "dense", None),
    ("int8-params", "ours", "identity@scatter_reduce#int8"),
    ("qsgd8", "ours", "qsgd:bits=8@scatter_reduce#full"),
    ("qsgd4", "ours", "qsgd:bits=4@scatter_reduce#full"),
    ("topk1%+ef", "ours", "topk:density=0.01@scatter_reduce#full"),
    ("sign+ef", "ours", "sign@scatter_reduce#full"),
    ("qsgd4+int8", "ours", "qsgd:bits=4@scatter_reduce#int8"),
    ("sign+ef+int8", "ours", "sign@scatter_reduce#int8"),
    # the DDP path on the same model and data (comms.register, allgather pinned: on loopback
    # auto would rightly pick dense), the quality the FSDP/HSDP rows are held to
    ("ddp-qsgd4", "ddp", "qsgd:bits=4"),
    ("ddp-topk1%+ef", "ddp", "topk:density=0.01"),
    ("ddp-sign+ef", "ddp", "sign"),
    ("fp16", "ours", "fp16@scatter_reduce#full"),
    ("bf16", "ours", "bf16@scatter_reduce#full"),
    ("torch-mp-bf16", "torch-mp", "bf16"),
    ("torch-mp-bf16-params", "torch-mp", "bf16-params"),
)
# also available with --hooks randomk (no target; kept out of the default run)
EXTRA = (("randomk1%+ef", "ours", "randomk:density=0.01@scatter_reduce#full"),)
# time to quality (--netsim): every row on its defaults, torch's policies beside
TTQ_CONFIGS = (
    ("dense", "dense", None),
    ("torch-mp-bf16-params", "torch-mp", "bf16-params"),
    ("torch-mp-bf16", "torch-mp", "bf16"),
    ("default(qsgd4)", "ours", "qsgd:bits=4"),
    ("default(sign)", "ours", "sign"),
    ("default(qsgd8)", "ours", "qsgd:bits=8"),
    ("default(topk1%)", "ours", "topk:density=0.01"),
    ("int8-params", "ours", "identity#int8"),
)


def shard_charlm(model, mesh, mp=None):
    """``fully_shard`` each transformer layer, then the root (embedding, positions, head)."""
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    for layer in model.blocks.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


# the FSDP/HSDP path's quality targets (final loss / dense in the same run)
TARGETS = {"int8-params": 1.01, "qsgd4": 1.01, "topk1%+ef": 1.10, "sign+ef": 1.02}


def _policy(spec: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if spec == "bf16-params":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return MixedPrecisionPolicy(reduce_dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[spec]))


def _ours(spec: str, hsdp: bool):
    """(compressor, register kwargs) of an "ours" row; HSDP keeps its own defaults."""
    from fsdp_step import _split

    name, kw = _split(spec)
    if hsdp:
        kw.pop("params", None)
        if kw.get("algorithm") == "scatter_reduce":
            kw["algorithm"] = next(a for a in ("allreduce", "allgather", "two_phase")
                                   if compressors.from_spec(name).supports(a))
    return name, kw


class SometimesUnused(torch.nn.Module):
    """The char transformer plus a root parameter (an output bias) that gets no gradient one
    step in ``every``: FSDP2 leaves such a parameter out of its reduce-scatter unless told."""

    def __init__(self, inner: torch.nn.Module, vocab: int, every: int):
        super().__init__()
        self.inner, self.every, self.step = inner, every, 0
        self.bias = torch.nn.Parameter(torch.zeros(vocab))

    @property
    def blocks(self):
        return self.inner.blocks

    def forward(self, x):
        out = self.inner(x)
        return out if self.step % self.every == self.every - 1 else out + self.bias


def _local(model) -> torch.Tensor:
    return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])


def _slowest(secs: float) -> float:
    t = torch.tensor([secs], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def train(task, cfg, args, rank: int, world: int, mesh, target=None, budget=None, max_steps=None):
    """Train the char transformer with ``cfg``; return (curve, replicas_equal, seconds, times).
    With ``budget``: stop once the smoothed held-out loss reaches ``target`` or the training
    clock (max over ranks, evaluations excluded) passes ``budget`` seconds."""
    name, kind, spec = cfg
    hsdp = args.mode == "hsdp"
    model = task.model()
    if args.unused_every:
        model = SometimesUnused(model, task.vocab, args.unused_every)
    state, opt = None, task.optimizer(model.parameters())
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, find_unused_parameters=bool(args.unused_every))
        state = comms.register(model, spec, optimizer=opt, algorithm="allgather",
                               start_iter=2 if args.start_iter is None else args.start_iter)
        hsdp = False
    elif kind == "dense":
        shard_charlm(model, mesh)  # 2-D mesh in HSDP mode: torch's native HSDP
    elif kind == "torch-mp":
        shard_charlm(model, mesh, _policy(spec))
    else:
        shard_charlm(model, mesh["shard"] if hsdp else mesh)
        opt = task.optimizer(model.parameters())  # the DTensor parameters FSDP2 made
        name_, kw = _ours(spec, hsdp)
        if args.start_iter is not None:
            kw["start_iter"] = args.start_iter
        state = comms.fsdp.register(model, name_, optimizer=opt,
                                    replicate_group=mesh.get_group("replicate") if hsdp else None, **kw)
    if kind in ("dense", "torch-mp"):  # FSDP2 replaced the parameters with DTensors
        opt = task.optimizer(model.parameters())
    inner = getattr(model, "module", model)
    curve, times = [(0, task.evaluate(model))], [0.0]
    secs, step = 0.0, 0
    while step < (max_steps or args.steps):
        t0 = time.perf_counter()
        step += 1
        x, y = task.batch_at(step - 1, rank, world)
        if args.unused_every:
            inner.step = step - 1
        opt.zero_grad()
        loss = task.loss(model(x), y)
        loss.backward()
        opt.step()
        secs += time.perf_counter() - t0  # the evaluations are off the clock
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, task.evaluate(model)))
            times.append(_slowest(secs))
            if budget is not None and (smoothed(curve, len(curve) - 1, args.tail) <= target
                                       or times[-1] >= budget):
                break  # the same decision on every rank: the same losses, the slowest clock
    equal = None
    if hsdp:  # each shard's replicas must hold the same bits (local shards vs the replicate peer)
        model.reshard()  # the root keeps its parameters unsharded after the last evaluation
        mine = _local(model)
        rg = mesh.get_group("replicate")
        peers = [torch.empty_like(mine) for _ in range(dist.get_world_size(rg))]
        dist.all_gather(peers, mine, group=rg)
        eq = torch.tensor([int(all(torch.equal(peers[0], p) for p in peers))])
        dist.all_reduce(eq, op=dist.ReduceOp.MIN)
        equal = bool(eq.item())
    if rank == 0 and getattr(state, "adam", None) is not None:
        print(f"# {name}: Adam's variance froze at step {state.adam.freeze_iter}", flush=True)
    bad = getattr(state, "nonfinite_modules", getattr(state, "nonfinite_buckets", 0))
    if bad:
        print(f"# rank {rank}: {name}: {bad} non-finite reductions", flush=True)
    resets = 0 if state is None else state.memory.layout_resets
    if resets and rank == 0:
        print(f"# {name}: {resets} error-feedback layout resets", flush=True)
    return curve, equal, _slowest(secs), times


def _ttq_shape(args):
    """The time-to-quality transformer: width 256, depth 4 (3.3M parameters), batch 8 per rank."""
    return argparse.Namespace(**{**vars(args), "width": args.width or 256, "depth": args.depth or 4})


def rank_main(rank: int, world: int, args):
    from torch.distributed.device_mesh import init_device_mesh

    if args.mode == "hsdp":
        if world % 2:
            raise SystemExit("--mode hsdp needs an even world (2 replicas x world/2 shards)")
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    task = CharLM12MTask(_ttq_shape(args)) if args.netsim_link else CharLMTask(args)
    configs = [c for c in CONFIGS + EXTRA if c[0] == "dense" or (
        any(h in c[0] for h in args.hooks.split(",")) if args.hooks else c in CONFIGS)]
    if rank == 0:
        print(f"# fsdp convergence: charlm mode={args.mode} world={world} steps={args.steps} "
              f"batch {task.batch}/rank eval every {args.eval_every}, final = mean of last {args.tail}",
              flush=True)
    if args.netsim_link:
        return ttq_main(task, args, rank, world, mesh)
    res, eq, secs = {}, {}, {}
    rows = None
    for cfg in configs:
        res[cfg[0]], eq[cfg[0]], secs[cfg[0]], _ = train(task, cfg, args, rank, world, mesh)
        if rank == 0:
            print(f"# {cfg[0]}: final {_final(res[cfg[0]], args.tail):.4f} ({secs[cfg[0]]:.0f} s)", flush=True)
            rows = _report(args, res, eq, secs, world, final=cfg is configs[-1])
    return rows


def ttq_main(task, args, rank: int, world: int, mesh):
    """Time to quality on the shaped link: dense FSDP2 trains ``--steps`` steps; every other
    row (:data:`TTQ_CONFIGS`, every default) until its smoothed held-out loss reaches dense's
    final loss, or for ``--budget`` x dense's training time. Floors in the same run: the
    step without communication and the transfer time of a dense step's bytes."""
    from fsdp_step import _rate_bps

    configs = [c for c in TTQ_CONFIGS if c[0] == "dense" or not args.hooks
               or any(h in c[0] for h in args.hooks.split(","))]
    load_before = _uptime()
    runs, target, budget = {}, None, None
    for cfg in configs:
        curve, _eq, secs, times = train(task, cfg, args, rank, world, mesh, target=target, budget=budget,
                                        max_steps=None if budget is None else int(args.steps * args.max_steps_factor))
        runs[cfg[0]] = {"curve": curve, "times": times, "wall_s": secs, "steps": curve[-1][0]}
        if cfg[0] == "dense":
            target, budget = _final(curve, args.tail), secs * args.budget
        if rank == 0:
            print(f"# {cfg[0]}: {curve[-1][0]} steps, {secs:.1f} s, final {_final(curve, args.tail):.4f}",
                  flush=True)
    # bench/convergence.py's floor: the unsharded model, no communication, every rank at once
    floor = task_floor(task, argparse.Namespace(floor_steps=10), rank, world)["step_ms"]
    if rank != 0:
        return None
    dense = runs["dense"]
    numel = sum(p.numel() for p in task.model().parameters())
    # dense FSDP2 per rank per step: two parameter all-gathers and gloo's reduce-scatter (an
    # all-reduce: 2 (W-1)/W of the gradient), fp32
    rate = _rate_bps(args.netsim_link)
    raw_ms = (2 + 2) * (world - 1) * numel * 4 / world * 8 / rate * 1e3 if rate else None
    rows = []
    for name, run in runs.items():
        step, t = time_to_quality(run, target, args.tail)
        rows.append({"hook": name, "steps": run["steps"], "step_ms": 1e3 * run["wall_s"] / run["steps"],
                     "final_loss": f"{_final(run['curve'], args.tail):.4f}",
                     "loss_ratio": f"{_final(run['curve'], args.tail) / target:.4f}",
                     "ttq_step": step if step is not None else "not reached",
                     "ttq_s": t if t is not None else "not reached",
                     "speedup": (time_to_quality(dense, target, args.tail)[1] / t) if t else None})
    best_torch = min((r["ttq_s"] for r in rows if r["hook"].startswith("torch") and r["speedup"]), default=None)
    for r in rows:
        r["vs_best_torch"] = best_torch / r["ttq_s"] if (best_torch and r["speedup"]) else None
        for k in ("speedup", "vs_best_torch"):  # three decimals: the targets are ratios
            r[k] = None if r[k] is None else f"{r[k]:.3f}"
    cols = ["hook", "steps", "step_ms", "final_loss", "loss_ratio", "ttq_step", "ttq_s", "speedup", "vs_best_torch"]
    print(tables.format_table(rows, cols), flush=True)
    if args.out:
        pngs = [_plot_ttq({k: dict(v, path="default" if k.startswith("default") else k) for k, v in runs.items()},
                          target, args.out, f"FSDP2 char transformer, {world} ranks, link {args.netsim_link}")
                ] if args.plot else []
        md = [f"# FSDP2 time to quality: char transformer, {world} ranks, link {args.netsim_link}", "",
              "```", args.command, "```", "",
              f"Machine: {machine.machine_facts()}. Load before: `{load_before}`; after: `{_uptime()}`.",
              f"Task: bench/convergence.py's char text with a {numel / 1e6:.1f}M-parameter causal "
              f"transformer (width {task.width}, depth {task.depth}), AdamW lr {task.lr}, batch "
              f"{task.batch} per rank; every transformer layer and the root fully_shard-ed. Dense "
              f"FSDP2 trains {args.steps} steps; every other row until its smoothed held-out loss "
              f"(mean of the last {args.tail} evaluations, every {args.eval_every} steps, off the "
              f"clock) reaches dense's final loss {target:.4f}, or for {args.budget}x dense's "
              "training time. `default(...)`: `comms.fsdp.register(model, spec, optimizer=opt)` "
              "with every other option at its default (algorithm and params `auto`); "
              "`int8-params`: identity gradients with `params=\"int8\"` (hand-picked); torch rows: "
              "`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)` / `(reduce_dtype=bf16)`. "
              "speedup: dense's ttq_s / the row's; vs_best_torch: the faster torch row's ttq_s / "
              "the row's.",
              f"Floors in this run: the step without communication (the model unsharded, every "
              f"rank at once) {floor:.1f} ms; a dense FSDP2 step's bytes at the link rate "
              f"{raw_ms:.1f} ms (two fp32 parameter all-gathers and gloo's all-reduce-based "
              "reduce-scatter).", "", tables.format_table(rows, cols, markdown=True), "",
              *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs]]
        tables.write_text(args.out + ".md", "\n".join(md) + "\n")
    return rows


def _report(args, res, eq, secs, world, final):
    """Rows of the configurations done so far; written after each one (a run cut short keeps
    what it finished), printed at the end."""
    dense_final = _final(res["dense"], args.tail)
    rows, curves = [], []
    for name, curve in res.items():
        fl = _final(curve, args.tail)
        tgt = TARGETS.get(name)
        ratio = fl / dense_final
        rows.append({"hook": name, "final_loss": f"{fl:.4f}", "ratio": f"{ratio:.4f}", "target": tgt,
                     "ok": None if tgt is None else ("yes" if ratio <= tgt else "NO"),
                     "replicas": None if eq[name] is None else ("equal" if eq[name] else "DIFFER"),
                     "train_s": secs[name]})
        curves += [{"task": "charlm", "hook": name, "step": s, "loss": v} for s, v in curve]
    cols = ["hook", "final_loss", "ratio", "target", "ok", "replicas", "train_s"]
    if final:
        print(tables.format_table(rows, cols), flush=True)
    if args.out:
        _write(args, rows, curves, cols, world, final)
    return rows


def _write(args, rows, curves, cols, world, final=True) -> None:
    out = args.out
    pngs = []
    if args.plot:
        tables.write_csv(out + ".csv", rows, cols)
        tables.write_csv(out + "_curves.csv", curves, ["task", "hook", "step", "loss"])
        pngs = _plot(curves, out)
    load = _uptime()
    what = ("FSDP2 (1-D mesh over all ranks; ours: compressed reduce-scatter)" if args.mode == "fsdp" else
            f"HSDP 2 x {world // 2} (dense: torch's native HSDP; ours: 1-D FSDP over the shard group + "
            "compressed all-reduce across the replicate group)")
    md = [f"# FSDP convergence: char transformer, {what}, {world} gloo ranks", "", "```",
          args.command, "```", "",
          f"Machine: {machine.machine_facts()}. Load at the end of the run: `{load}`.",
          f"Task: bench/convergence.py's charlm (2-layer width-128 causal transformer on the stdlib's "
          f".py source, AdamW lr 2e-3, batch {args.batch or 16} per rank, global batch "
          f"{(args.batch or 16) * world}), {args.steps} steps for every row, fixed "
          f"seeds, the same data order; held-out loss every {args.eval_every} steps; final = mean of "
          f"the last {args.tail} evaluations; ratio = final / dense final in this run. Ours start compressing after {args.start_iter} dense steps (as bench/convergence.py). "
          "`replicas`: HSDP only, each rank's local shards bitwise equal to its replicate peer's "
          "after training. train_s: wall seconds of training (unshaped loopback, shared cores; not a "
          "speed result)." + ("" if final else " **Partial: the run had not finished (or was cut "
                             "short) when this was written; only the rows below completed.**"), "", tables.format_table(rows, cols, markdown=True), ""]
    md += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs]
    tables.write_text(out + ".md", "\n".join(md) + "\n")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    launching.add_launch_args(p)
    # 8 rows x 300 steps took 25-50 min on the shared 2 cores; the harness's 1800 s cut a run short
    p.set_defaults(timeout=7200.0)
    p.add_argument("--mode", choices=("fsdp", "hsdp"), default="fsdp")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--tail", type=int, default=5)
    p.add_argument("--batch", type=int, default=None, help="per rank (default 16)")
    p.add_argument("--lr", type=float, default=None, help="AdamW (default 2e-3)")
    p.add_argument("--start-iter", type=int, default=None,
                   help="ours: dense steps before compressing (equal-step rows: 2, as bench/convergence.py; "
                        "time to quality: the default)")
    p.add_argument("--width", type=int, default=None, help="time to quality: transformer width (256)")
    p.add_argument("--depth", type=int, default=None, help="time to quality: transformer layers (4)")
    p.add_argument("--budget", type=float, default=1.0, help="time to quality: x dense's training time")
    p.add_argument("--max-steps-factor", type=float, default=4.0, help=argparse.SUPPRESS)
    p.add_argument("--netsim-link", default=None, help=argparse.SUPPRESS)
    p.add_argument("--unused-every", type=int, default=0,
                   help="add a root parameter that gets no gradient one step in N (0: none)")
    p.add_argument("--hooks", default=None, help="comma-separated substrings of row names (dense always runs)")
    p.add_argument("--out", default=None, help="write OUT.md")
    p.add_argument("--plot", action="store_true", help="also OUT.csv, OUT_curves.csv and the plot")
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.command is None:
        args.command = launching.shell_command(argv)
        argv = [*argv, "--command", args.command]
    if args.netsim and args.netsim_link is None:  # time to quality; the netsim children never
        args.netsim_link = args.netsim             # see --netsim: tell them
        argv = [*argv, "--netsim-link", args.netsim]
    if args.netsim_link is None and args.start_iter is None:
        args.start_iter = 2
    return launching.launch(os.path.abspath(__file__), rank_main, args, argv)


if __name__ == "__main__":
    main()
