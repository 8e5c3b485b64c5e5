"""Quality at equal steps under AdamW: final loss of each compressor against dense allreduce
over a matrix of tasks the defaults were not tuned on.

A cell is a model size, a peak learning rate and a regime; in every cell, for every world
size and seed, each row trains from the same initial weights on the same batches. The task is
bench/convergence.py's ``charlm`` text (the Python standard library's source, 64-character
sequences, batch 16 per rank) with a causal transformer of ``--models`` (``WIDTHxDEPTH``, 4
heads), AdamW (weight decay 0), ``--steps`` steps (default 300). Regimes:

* ``plain``: a constant learning rate, no clipping;
* ``clip-cosine``: ``torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)`` after every
  backward and a linear warm-up over the first 10% of the steps, then cosine decay to 10% of
  the peak (``LambdaLR``, stepped after ``optimizer.step()``) — the loop of Hugging Face's
  ``Trainer`` and nanoGPT.

Rows:

* ``dense``: plain DDP allreduce;
* ``SPEC``: ``comms.register(ddp, SPEC, optimizer=opt, algorithm=ALGO)`` with every other
  default: with AdamW and a biased compressor (sign, top-k, random-k) that is the momentum-space
  scheme (:mod:`comms.core.adam`); QSGD and fp16 keep the gradient path;
* ``SPEC [gradient path]`` (``--paths gradient``): the same with ``adam_freeze=None``.

**Pinned**: every compressed row is README's usage with ``algorithm="allgather"`` pinned
(``--algorithm``): a hand-picked setting, since on loopback ``auto`` rightly keeps dense
allreduce and there would be nothing to compare. The final
loss is the mean of the last ``--tail`` evaluations (64 fixed held-out sequences); ratio = final
/ dense's final in the same cell, world size and seed. ``replicas`` = every rank's parameters
bitwise equal at the end; ``dense_steps`` = the steps whose every bucket went dense (Adam's
variance settling and refreshes, the top-k warm-up ramp's dense steps). Results are merged by
(cell, world, seed, row) into OUT.csv; ``--fresh`` starts over.

    python bench/adam_quality.py                       # the whole matrix
    python bench/adam_quality.py --models 64x2 --lrs 3e-3 --regimes clip-cosine -n 2 --seeds 0
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import os
import statistics
import subprocess
import sys
import time

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # for harness; last, so that
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/*.py never shadow packages
import harness  # noqa: E402  (puts the repository root first on sys.path)
from harness import launching, machine, tables  # noqa: E402

import torch  # noqa: E402

__all__ = ["TARGETS", "GRADIENT", "REGIMES", "lr_factor", "main"]

# final-loss ratio to dense each momentum-space row should stay within (the bar)
TARGETS = (("sign", 1.02), ("topk", 1.05), ("randomk", 1.10), ("qsgd:bits=4", 1.01),
           ("qsgd:bits=8", 1.01))
GRADIENT = " [gradient path]"  # suffix of the adam_freeze=None rows
REGIMES = ("plain", "clip-cosine")
CLIP = 1.0          # clip-cosine's clip_grad_norm_ limit
WARMUP = 0.1        # clip-cosine's linear warm-up, a share of the steps
FLOOR = 0.1         # clip-cosine's final learning rate, a share of the peak
CELL = ["model", "lr", "regime"]
COLUMNS = CELL + ["world", "seed", "row", "final_loss", "ratio", "target", "max_loss", "finite",
                  "replicas", "freeze_iter", "dense_steps", "train_s", "load"]
META = ["command", "commit", "machine"]


def target_for(row: str) -> float | None:
    """The ratio bar of a momentum-space row (none for dense and the gradient-path rows)."""
    if row.endswith(GRADIENT):
        return None
    return next((r for prefix, r in TARGETS if row.startswith(prefix)), None)


def lr_factor(step: int, steps: int) -> float:
    """clip-cosine's learning-rate factor at ``step`` (0-based) of ``steps``: linear warm-up
    over the first ``WARMUP`` of the steps, then cosine decay to ``FLOOR``."""
    warm = max(1, int(WARMUP * steps))
    if step < warm:
        return (step + 1) / warm
    done = (step - warm) / max(1, steps - warm)
    return FLOOR + (1.0 - FLOOR) * 0.5 * (1.0 + math.cos(math.pi * done))


def _rows(args) -> list[tuple[str, str | None, dict]]:
    """(row name, spec or None for dense, extra register keywords)."""
    specs = [s.strip() for s in args.specs.split(";") if s.strip()]
    out = [("dense", None, {})]
    if "momentum" in args.paths:
        out += [(s, s, {}) for s in specs]
    if "gradient" in args.paths:
        out += [(s + GRADIENT, s, {"adam_freeze": None}) for s in specs]
    return out


def _fingerprint(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _train_row(task, spec, extra, args, rank: int, world: int) -> dict:
    import comms
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = task.model()
    ddp = DDP(model)
    opt = task.optimizer(ddp.parameters())
    clip = args.regime == "clip-cosine"
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps))
             if clip else None)
    state = (comms.register(ddp, spec, optimizer=opt, algorithm=args.algorithm, **extra)
             if spec else None)
    evals, dense_steps, per_step = [], 0, None
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = task.batch_at(step - 1, rank, world)
        opt.zero_grad()
        before = state.dense_calls if state is not None else 0
        task.loss(ddp(x), y).backward()
        if state is not None:  # a step whose every bucket went dense (step 1 always does)
            per_step = per_step or state.dense_calls - before
            dense_steps += state.dense_calls - before >= per_step
        if clip:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        opt.step()
        if sched is not None:
            sched.step()
        if step % args.eval_every == 0 or step == args.steps:
            evals.append(task.evaluate(model))
    adam = getattr(state, "adam", None)
    tail = evals[-args.tail:]
    return {"final_loss": sum(tail) / len(tail), "max_loss": max(evals),
            "finite": all(math.isfinite(v) for v in evals), "fp": _fingerprint(model),
            "freeze_iter": adam.freeze_iter if adam is not None else None,
            "dense_steps": dense_steps if state is not None else args.steps,
            "train_s": time.perf_counter() - t0}


def _task(args):
    """charlm's text and evaluation with a ``WIDTHxDEPTH`` transformer and the cell's lr."""
    from convergence import CharLMTask
    from ddp_step import TinyLM

    width, depth = (int(v) for v in args.model.split("x"))

    class Task(CharLMTask):
        def model(self):
            torch.manual_seed(self.seed)
            return TinyLM(width=width, depth=depth, vocab=self.vocab, seq=self.seq, heads=4)

    return Task(argparse.Namespace(batch=args.batch, lr=args.lr, seed=args.seed))


def _body(rank: int, world: int, args, rows):
    task = _task(args)
    return {name: _train_row(task, spec, extra, args, rank, world) for name, spec, extra in rows}


def run_one(args, world: int, seed: int) -> list[dict]:
    """Every row of one cell at one world size and seed, in one set of ranks."""
    from comms.cluster.launch import spawn

    a = argparse.Namespace(**vars(args))
    a.seed = seed
    per_rank = spawn(_body, world, a, _rows(args), timeout=args.timeout)
    dense = per_rank[0]["dense"]["final_loss"]
    out = []
    for name in per_rank[0]:
        r = per_rank[0][name]
        out.append({"model": args.model, "lr": args.lr, "regime": args.regime, "world": world,
                    "seed": seed, "row": name, "final_loss": r["final_loss"],
                    "ratio": r["final_loss"] / dense, "target": target_for(name),
                    "max_loss": r["max_loss"], "finite": r["finite"],
                    "replicas": all(p[name]["fp"] == r["fp"] for p in per_rank),
                    "freeze_iter": r["freeze_iter"], "dense_steps": r["dense_steps"],
                    "train_s": max(p[name]["train_s"] for p in per_rank)})
    return out


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _cell_key(r: dict) -> tuple:
    return (r["model"], float(r["lr"]), r["regime"], int(r["world"]))


def _merge(old: list[dict], new: list[dict]) -> list[dict]:
    key = lambda r: (*_cell_key(r), int(r["seed"]), r["row"])  # noqa: E731
    got = {key(r): r for r in old}
    got.update({key(r): r for r in new})
    return [got[k] for k in sorted(got, key=lambda k: k[:5])]


def _f(v) -> float | None:
    return None if v in (None, "", "None") else float(v)


def _iter(v) -> str:
    return "-" if v in (None, "", "None") else str(v)


def _summary(recs: list[dict]) -> list[dict]:
    """Per cell, world size and row: the ratio at each seed, the mean, the worst, the bar."""
    out = []
    for cell in sorted({_cell_key(r) for r in recs}):
        mine = [r for r in recs if _cell_key(r) == cell]
        seeds = sorted({int(r["seed"]) for r in mine})
        for name in dict.fromkeys(r["row"] for r in mine):
            rs = {int(r["seed"]): r for r in mine if r["row"] == name}
            ratios = [float(rs[s]["ratio"]) for s in seeds if s in rs]
            row = dict(zip(CELL + ["world"], cell), row=name)
            for i, s in enumerate(seeds):
                row[f"seed{i}"] = float(rs[s]["ratio"]) if s in rs else None
            tgt = target_for(name)
            mean = statistics.fmean(ratios)
            row.update({"mean": mean, "worst": max(ratios), "target": tgt,
                        "met": None if tgt is None else ("yes" if mean <= tgt else "MISSED"),
                        "finite": all(str(rs[s]["finite"]) == "True" for s in rs),
                        "replicas": all(str(rs[s]["replicas"]) == "True" for s in rs),
                        "freeze_iter": ",".join(_iter(rs[s]["freeze_iter"]) for s in sorted(rs)),
                        "dense_steps": ",".join(_iter(rs[s].get("dense_steps")) for s in sorted(rs))})
            out.append(row)
    return out


def _shown(row: dict) -> dict:
    """Ratios and losses to 4 decimals, seconds whole (the table's 3 digits hide 1.004)."""
    out = dict(row)
    for k, v in row.items():
        if k not in ("final_loss", "ratio", "max_loss", "train_s", "mean", "worst") and \
                not (k.startswith("seed") and k != "seed"):
            continue
        v = _f(v) if isinstance(v, str) else v
        if isinstance(v, float):
            out[k] = f"{v:.0f}" if k == "train_s" else f"{v:.4f}"
    return out


def _verdict(summary: list[dict]) -> list[str]:
    """One line per bar: the cells that met it, the worst mean, the cells that missed."""
    lines = []
    for prefix, bar in TARGETS:
        rows = [r for r in summary if r["target"] == bar and r["row"].startswith(prefix)]
        if not rows:
            continue
        worst = max(rows, key=lambda r: r["mean"])
        missed = [r for r in rows if r["met"] != "yes"]
        lines.append(f"- `{worst['row']}` <= {bar}x: met in {len(rows) - len(missed)} of {len(rows)} "
                     f"cells; worst mean {worst['mean']:.4f} ({worst['model']}, lr {worst['lr']}, "
                     f"{worst['regime']}, {worst['world']} ranks)")
        lines += [f"  - MISSED: {r['model']}, lr {r['lr']}, {r['regime']}, {r['world']} ranks: "
                  f"mean {r['mean']:.4f}" for r in missed]
    diverged = [r for r in summary if not r["finite"]]
    lines.append(f"- non-finite evaluations: {len(diverged)} cells"
                 + "".join(f"; {r['row']} ({r['model']}, lr {r['lr']}, {r['regime']}, "
                           f"{r['world']} ranks)" for r in diverged))
    return lines


def _write(out: str, recs: list[dict]) -> None:
    tables.write_csv(out + ".csv", recs, COLUMNS + META)
    summary = _summary(recs)
    nseeds = max(len({r["seed"] for r in recs if _cell_key(r) == c}) for c in {_cell_key(r) for r in recs})
    cols = (CELL + ["world", "row"] + [f"seed{i}" for i in range(nseeds)]
            + ["mean", "worst", "target", "met", "finite", "replicas", "freeze_iter", "dense_steps"])
    runs = list(dict.fromkeys(tuple(r[m] for m in META) for r in recs))
    md = ["# Quality at equal steps under AdamW: final loss against dense allreduce", ""]
    for command, commit, facts in runs:
        md += ["```", command, "```", "", f"Commit `{commit}`. Machine: {facts}.", ""]
    md += ["\n\n".join(__doc__.split("\n\n")[1:7]), "", "## Against the targets", ""]
    md += _verdict(summary) + [""]
    md += ["Columns: `seedI` — final-loss ratio to dense at the I-th seed; `mean`/`worst` over the "
           "seeds; `target` — the bar for the row (`met` compares the mean); `finite` — every "
           "evaluation finite at every seed; `replicas` — parameters bitwise equal on every rank at "
           "every seed; `freeze_iter` — the step the variance first froze, per seed (`-`: never, the "
           "gradient path); `dense_steps` — steps whose every bucket went dense, per seed.", "",
           tables.format_table([_shown(r) for r in summary], cols, markdown=True), "",
           "Every run (final loss; the largest evaluation loss; training seconds, max over ranks; "
           "`load`: the 1-minute load average before -> after the seed's ranks ran):",
           "", tables.format_table([_shown(r) for r in recs], COLUMNS, markdown=True)]
    tables.write_text(out + ".md", "\n".join(md) + "\n")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=harness.ROOT).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError, AttributeError):
        return "unknown"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (bench/convergence.py's --seed)")
    p.add_argument("--models", default="64x2,128x2", help="comma-separated WIDTHxDEPTH transformers")
    p.add_argument("--lrs", default="1e-3,3e-3", help="comma-separated peak AdamW learning rates")
    p.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated, of {REGIMES}")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--specs", default="sign;topk:density=0.01;qsgd:bits=4",
                   help="';'-separated compressor specs")
    p.add_argument("--paths", default="momentum",
                   help="momentum: the default pairing with AdamW; gradient: adam_freeze=None")
    p.add_argument("--algorithm", default="allgather", help="pinned algorithm of every row")
    p.add_argument("--batch", type=int, default=None, help="per rank (charlm's default 16)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--tail", type=int, default=5, help="evaluations averaged into the final loss")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per set of ranks")
    p.add_argument("--out", default=os.path.join(harness.RESULTS, "adam_quality"),
                   help="OUT.md and OUT.csv (merged with an existing OUT.csv)")
    p.add_argument("--fresh", action="store_true", help="ignore an existing OUT.csv")
    return p


def _cells(args) -> list[tuple[str, float, str]]:
    try:
        lrs = [float(v) for v in args.lrs.split(",")]
        models = args.models.split(",")
        for m in models:
            w, d = (int(v) for v in m.split("x"))
            if w < 4 or w % 4 or d < 1:
                raise ValueError(m)
    except ValueError:
        raise SystemExit(f"--models {args.models!r} must be WIDTHxDEPTH (width a multiple of 4) "
                         f"and --lrs {args.lrs!r} numbers")
    regimes = args.regimes.split(",")
    if set(regimes) - set(REGIMES) or any(lr <= 0 for lr in lrs):
        raise SystemExit(f"--regimes {args.regimes!r}: known {REGIMES}; --lrs must be > 0")
    return [(m, lr, r) for m in models for lr in lrs for r in regimes]


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"--worlds {args.worlds!r} and --seeds {args.seeds!r} must be integers")
    if any(w < 2 for w in worlds) or args.steps < 1 or args.eval_every < 1 or args.tail < 1:
        raise SystemExit("world sizes must be >= 2; --steps, --eval-every, --tail >= 1")
    bad = set(args.paths.split(",")) - {"momentum", "gradient"}
    if bad:
        raise SystemExit(f"--paths {sorted(bad)}: known momentum, gradient")
    cells = _cells(args)
    meta = {"command": launching.shell_command(argv), "commit": _commit(),
            "machine": machine.machine_facts()}
    recs = [] if args.fresh else _read(args.out + ".csv")
    for model, lr, regime in cells:
        args.model, args.lr, args.regime = model, lr, regime
        for world in worlds:
            for seed in seeds:
                before = os.getloadavg()[0]
                new = run_one(args, world, seed)
                load = f"{before:.2f} -> {os.getloadavg()[0]:.2f}"
                for r in new:
                    r.update(meta, load=load)
                    print(f"# {model} lr {lr:g} {regime} world {world} seed {seed} {r['row']:24s} "
                          f"final {r['final_loss']:.4f} ratio {r['ratio']:.4f} replicas "
                          f"{r['replicas']} freeze {r['freeze_iter']} dense {r['dense_steps']} "
                          f"{r['train_s']:.0f}s", flush=True)
                recs = _merge(recs, new)
                if args.out:
                    _write(args.out, recs)  # after every seed: a cut run keeps what it measured
    summary = _summary(recs)
    print(tables.format_table(summary, CELL + ["world", "row", "mean", "worst", "target", "met",
                                               "finite", "replicas", "freeze_iter"]), flush=True)
    return summary


if __name__ == "__main__":
    main()
