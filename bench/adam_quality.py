"""Quality at equal steps under AdamW: final loss of each compressor against dense allreduce,
momentum-space compression with a frozen variance next to the gradient path.

The task is bench/convergence.py's ``charlm`` (a 2-layer character transformer on the Python
standard library's source, AdamW lr 2e-3, batch 16 per rank, 300 steps by default). For every
world size and seed, each row trains from the same initial weights on the same batches:

* ``dense``: plain DDP allreduce;
* ``SPEC``: ``comms.register(ddp, SPEC, optimizer=opt, algorithm=ALGO)`` with every other
  default: with AdamW and a biased compressor (sign, top-k, random-k) that is the momentum-space
  scheme (dense Adam until the variance settles, then the variance frozen and the momentum
  compressed with error feedback); QSGD and fp16 keep the gradient path;
* ``SPEC [gradient path]``: the same with ``adam_freeze=None`` (error feedback on the gradient,
  the optimizer untouched), for comparison.

The algorithm is pinned (``--algorithm``, default ``allgather``): a hand-picked setting, since on
loopback ``auto`` rightly picks dense allreduce and there would be nothing to compare. The final
loss is the mean of the last ``--tail`` evaluations (64 fixed held-out sequences); ratio = final
/ dense's final at the same world size and seed. ``replicas`` = every rank's parameters bitwise
equal at the end. Results are merged by (world, seed, row) into OUT.csv, so a world size or seed
can be added by a later run; OUT.md is rewritten from all of them.

    python bench/adam_quality.py                             # 2 ranks, seeds 0,1,2, every row
    python bench/adam_quality.py -n 4 --seeds 0,1,2 --paths momentum
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

__all__ = ["TARGETS", "GRADIENT", "main"]

# final-loss ratio to dense each momentum-space row should stay within (the bar)
TARGETS = (("sign", 1.02), ("topk", 1.05), ("randomk", 1.10), ("qsgd:bits=4", 1.01),
           ("qsgd:bits=8", 1.01))
GRADIENT = " [gradient path]"  # suffix of the adam_freeze=None rows
COLUMNS = ["world", "seed", "row", "final_loss", "ratio", "target", "max_loss", "finite",
           "replicas", "freeze_iter", "train_s", "load"]
META = ["command", "commit", "machine"]


def target_for(row: str) -> float | None:
    """The ratio bar of a momentum-space row (none for dense and the gradient-path rows)."""
    if row.endswith(GRADIENT):
        return None
    return next((r for prefix, r in TARGETS if row.startswith(prefix)), None)


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
    state = (comms.register(ddp, spec, optimizer=opt, algorithm=args.algorithm, **extra)
             if spec else None)
    evals = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = task.batch_at(step - 1, rank, world)
        opt.zero_grad()
        task.loss(ddp(x), y).backward()
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            evals.append(task.evaluate(model))
    adam = getattr(state, "adam", None)
    tail = evals[-args.tail:]
    return {"final_loss": sum(tail) / len(tail), "max_loss": max(evals),
            "finite": all(math.isfinite(v) for v in evals), "fp": _fingerprint(model),
            "freeze_iter": adam.freeze_iter if adam is not None else None,
            "train_s": time.perf_counter() - t0}


def _body(rank: int, world: int, args, rows):
    from convergence import CharLMTask

    task = CharLMTask(argparse.Namespace(batch=args.batch, lr=args.lr, seed=args.seed))
    return {name: _train_row(task, spec, extra, args, rank, world) for name, spec, extra in rows}


def run_one(args, world: int, seed: int) -> list[dict]:
    """Every row at one world size and seed, in one set of ranks."""
    from comms.cluster.launch import spawn

    a = argparse.Namespace(**vars(args))
    a.seed = seed
    per_rank = spawn(_body, world, a, _rows(args), timeout=args.timeout)
    dense = per_rank[0]["dense"]["final_loss"]
    out = []
    for name in per_rank[0]:
        r = per_rank[0][name]
        out.append({"world": world, "seed": seed, "row": name, "final_loss": r["final_loss"],
                    "ratio": r["final_loss"] / dense, "target": target_for(name),
                    "max_loss": r["max_loss"], "finite": r["finite"],
                    "replicas": all(p[name]["fp"] == r["fp"] for p in per_rank),
                    "freeze_iter": r["freeze_iter"],
                    "train_s": max(p[name]["train_s"] for p in per_rank)})
    return out


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _merge(old: list[dict], new: list[dict]) -> list[dict]:
    key = lambda r: (int(r["world"]), int(r["seed"]), r["row"])  # noqa: E731
    got = {key(r): r for r in old}
    got.update({key(r): r for r in new})
    return [got[k] for k in sorted(got, key=lambda k: (k[0], k[1]))]


def _f(v) -> float | None:
    return None if v in (None, "", "None") else float(v)


def _iter(v) -> str:
    return "-" if v in (None, "", "None") else str(v)


def _summary(recs: list[dict]) -> list[dict]:
    """Per world size and row: the ratio at each seed, the mean, the worst, the bar."""
    out = []
    for world in sorted({int(r["world"]) for r in recs}):
        mine = [r for r in recs if int(r["world"]) == world]
        seeds = sorted({int(r["seed"]) for r in mine})
        for name in dict.fromkeys(r["row"] for r in mine):
            rs = {int(r["seed"]): r for r in mine if r["row"] == name}
            ratios = [float(rs[s]["ratio"]) for s in seeds if s in rs]
            row = {"world": world, "row": name}
            for s in seeds:
                row[f"seed{s}"] = float(rs[s]["ratio"]) if s in rs else None
            tgt = target_for(name)
            row.update({"mean": statistics.fmean(ratios), "worst": max(ratios), "target": tgt,
                        "met": None if tgt is None else ("yes" if statistics.fmean(ratios) <= tgt
                                                         else "MISSED"),
                        "finite": all(str(rs[s]["finite"]) == "True" for s in rs),
                        "replicas": all(str(rs[s]["replicas"]) == "True" for s in rs),
                        "freeze_iter": ",".join(_iter(rs[s]["freeze_iter"]) for s in sorted(rs))})
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


def _write(out: str, recs: list[dict]) -> None:
    tables.write_csv(out + ".csv", recs, COLUMNS + META)
    summary = _summary(recs)
    seeds = sorted({int(r["seed"]) for r in recs})
    cols = (["world", "row"] + [f"seed{s}" for s in seeds]
            + ["mean", "worst", "target", "met", "finite", "replicas", "freeze_iter"])
    runs = list(dict.fromkeys(tuple(r[m] for m in META) for r in recs))
    md = ["# Quality at equal steps under AdamW: final loss against dense allreduce", ""]
    for command, commit, facts in runs:
        md += ["```", command, "```", "", f"Commit `{commit}`. Machine: {facts}.", ""]
    md += ["\n\n".join(__doc__.split("\n\n")[1:4]), "",
           "Columns: `seedS` — final-loss ratio to dense at seed S; `mean`/`worst` over the seeds; "
           "`target` — the bar for the momentum-space row (`met` compares the mean); `finite` — "
           "every evaluation finite at every seed; `replicas` — parameters bitwise equal on every "
           "rank at every seed; `freeze_iter` — the step the variance froze, per seed (empty: no "
           "freeze, the gradient path).", "",
           tables.format_table([_shown(r) for r in summary], cols, markdown=True), "",
           "Every run (final loss; the largest evaluation loss; training seconds, max over ranks; "
           "`load`: the 1-minute load average before -> after the seed's ranks ran; `commit`: the "
           "checkout that ran it):",
           "", tables.format_table([_shown(r) for r in recs], COLUMNS + ["commit"], markdown=True)]
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
    p.add_argument("-n", "--worlds", default="2", help="comma-separated world sizes (default 2)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (bench/convergence.py's --seed)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--specs", default="sign;topk:density=0.01;qsgd:bits=4",
                   help="';'-separated compressor specs")
    p.add_argument("--paths", default="momentum,gradient",
                   help="momentum: the default pairing with AdamW; gradient: adam_freeze=None")
    p.add_argument("--algorithm", default="allgather", help="pinned algorithm of every row")
    p.add_argument("--batch", type=int, default=None, help="per rank (charlm's default 16)")
    p.add_argument("--lr", type=float, default=None, help="AdamW lr (charlm's default 2e-3)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--tail", type=int, default=5, help="evaluations averaged into the final loss")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per set of ranks")
    p.add_argument("--out", default=os.path.join(harness.RESULTS, "adam_quality"),
                   help="OUT.md and OUT.csv (merged with an existing OUT.csv)")
    p.add_argument("--fresh", action="store_true", help="ignore an existing OUT.csv")
    return p


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
    meta = {"command": launching.shell_command(argv), "commit": _commit(),
            "machine": machine.machine_facts()}
    recs = [] if args.fresh else _read(args.out + ".csv")
    for world in worlds:
        for seed in seeds:
            before = os.getloadavg()[0]
            new = run_one(args, world, seed)
            load = f"{before:.2f} -> {os.getloadavg()[0]:.2f}"
            for r in new:
                r.update(meta, load=load)
                print(f"# world {world} seed {seed} {r['row']:36s} final {r['final_loss']:.4f} "
                      f"ratio {r['ratio']:.4f} replicas {r['replicas']} freeze "
                      f"{r['freeze_iter']} {r['train_s']:.0f}s", flush=True)
            recs = _merge(recs, new)
            if args.out:
                _write(args.out, recs)  # after every seed: a cut run keeps what it measured
    summary = _summary(recs)
    print(tables.format_table(summary, ["world", "row", "mean", "worst", "target", "met",
                                        "finite", "replicas", "freeze_iter"]), flush=True)
    return summary


if __name__ == "__main__":
    main()
