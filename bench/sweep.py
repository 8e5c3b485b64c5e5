"""DDP step time against link rate for every hook: a table and a PNG plot.

For each rate, ``bench/ddp_step.py --netsim RATE`` runs every hook in one process group on
netsim hosts (one rank per host, links token-bucket shaped to RATE; needs root). The sweep
holds ``/tmp/bench.lock`` for its whole run; each rate takes ``/tmp/netsim.lock``.

    python bench/sweep.py                                   # 0.5, 1, 2.5, 10 Gb/s; 2 ranks; MLP 25M
    python bench/sweep.py --rates 1gbit,10gbit --hooks torch-psgd-r1,qsgd8@shared_scale,auto
    python bench/sweep.py --loopback                        # no shaping (not root): one column

Writes ``bench/results/sweep.{md,csv,png}`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # for harness; last, so that
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/*.py never shadow packages
import harness  # noqa: E402  (puts the repository root first on sys.path)
from harness import launching, locks, tables  # noqa: E402

__all__ = ["rate_gbps", "run_rate", "main"]

logger = logging.getLogger(__name__)

DEFAULT_RATES = "500mbit,1gbit,2500mbit,10gbit"
_UNITS = {"kbit": 1e-6, "mbit": 1e-3, "gbit": 1.0}


def rate_gbps(rate: str) -> float:
    """``"500mbit"`` -> 0.5, ``"10gbit"`` -> 10.0 (tc's rate syntax)."""
    r = rate.strip().lower()
    for unit, scale in _UNITS.items():
        if r.endswith(unit):
            return float(r[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: expected a number followed by kbit, mbit or gbit")


def run_rate(rate: str | None, args) -> dict:
    """One ``ddp_step`` run (all hooks) at ``rate`` (``None``: unshaped loopback)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_step.py")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, script, "-n", str(args.nprocs), "--model", args.model,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--json", path, "--out", "", "--no-lock", "--no-progress", "--no-codec"]
        for flag, v in (("--width", args.width), ("--depth", args.depth), ("--hooks", args.hooks)):
            if v is not None:
                cmd += [flag, str(v)]
        if rate is not None:
            cmd += ["--netsim", rate]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=args.timeout)
        if proc.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"ddp_step at {rate or 'loopback'} failed (rc={proc.returncode}):\n"
                               f"{proc.stdout[-4000:]}")
        if args.verbose:
            print(proc.stdout, file=sys.stderr)
        with open(path) as f:
            return json.load(f)


def _plot(table: dict, labels: list[str], gbps: list[float | None], out: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [g for g in gbps if g is not None]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5.5))
    cmap = plt.get_cmap("tab20")
    for i, (hook, row) in enumerate(table.items()):
        ys = [row.get(lab) for lab, g in zip(labels, gbps) if g is not None]
        sp = [table["dense"][lab] / row[lab] if row.get(lab) else None
              for lab, g in zip(labels, gbps) if g is not None]
        style = dict(color="black" if hook == "dense" else cmap(i % 20), marker="o", markersize=3,
                     linewidth=2.2 if hook == "dense" else 1.1,
                     linestyle="--" if hook.startswith("torch") else "-", label=hook)
        a1.plot(xs, ys, **style)
        a2.plot(xs, sp, **style)
    for ax in (a1, a2):
        ax.set_xscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{g:g}" for g in xs])
        ax.set_xlabel("link rate (Gb/s, each way, per host)")
        ax.grid(True, which="both", alpha=0.3)
    a1.set_yscale("log")
    a1.set_ylabel("median step time (ms)")
    a2.set_ylabel("speedup over dense allreduce")
    a2.axhline(1.0, color="grey", linewidth=0.8)
    a2.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    path = out + ".png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nprocs", type=int, default=2, help="ranks (one per netsim host)")
    p.add_argument("--rates", default=DEFAULT_RATES, help="comma-separated tc rates")
    p.add_argument("--loopback", action="store_true",
                   help="no shaping at all: one unshaped column (no root needed)")
    p.add_argument("--unshaped", action="store_true", help="add an unshaped column to the rates")
    p.add_argument("--model", default="mlp")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--depth", type=int, default=None)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5, help="measured steps per hook and rate")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--hooks", default=None, help="comma-separated hook names or substrings")
    p.add_argument("--out", default=os.path.join(harness.RESULTS, "sweep"),
                   help="write OUT.md, OUT.csv and OUT.png")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per rate")
    p.add_argument("--no-lock", action="store_true", help="do not hold /tmp/bench.lock")
    p.add_argument("-v", "--verbose", action="store_true", help="echo each ddp_step table")
    args = p.parse_args(argv)

    runs: list[str | None] = [None] if args.loopback else [r.strip() for r in args.rates.split(",")]
    if args.unshaped and not args.loopback:
        runs.append(None)
    for r in runs:
        if r is not None:
            rate_gbps(r)  # bad rates fail before anything runs
    labels = [r if r is not None else "unshaped" for r in runs]
    gbps = [rate_gbps(r) if r is not None else None for r in runs]
    command = launching.shell_command(argv)

    import contextlib

    lock = contextlib.nullcontext() if args.no_lock else locks.file_lock(locks.BENCH_LOCK, "(bench)")
    results = {}
    with lock:
        for rate, label in tables.progress(list(zip(runs, labels)), total=len(runs), desc="rates"):
            results[label] = run_rate(rate, args)
    meta = next(iter(results.values()))["meta"]
    table: dict[str, dict] = {}
    for label, res in results.items():
        for row in res["rows"]:
            table.setdefault(row["hook"], {"hook": row["hook"]})[label] = row["step_ms"]
            table[row["hook"]]["wire_MB"] = row["wire_MB"]
    rows = []
    for hook, row in table.items():
        r = dict(row)
        for label in labels:
            if row.get(label):
                r[f"x@{label}"] = table["dense"][label] / row[label]
        rows.append(r)
    cols = ["hook", "wire_MB"] + [f"{lab}" for lab in labels] + [f"x@{lab}" for lab in labels]
    print(f"# sweep: model={meta['model']} params={meta['params']} world={meta['world']} "
          f"batch={meta['batch']}/rank; median step ms at each link rate, then speedup over dense")
    for what, why in meta.get("skipped", []):
        print(f"# skipped {what}: {why}")
    print(tables.format_table(rows, cols), flush=True)
    if args.out:
        tables.write_csv(args.out + ".csv", rows, cols)
        title = (f"DDP step time vs link rate: {meta['model']} ({meta['params'] / 1e6:.1f}M params), "
                 f"{meta['world']} ranks, batch {meta['batch']}/rank")
        png = _plot(table, labels, gbps, args.out, title) if any(g is not None for g in gbps) else None
        md = [f"# Step time against link rate ({meta['model']}, {meta['world']} ranks)", "", "```",
              command, "```", "",
              f"Machine: {meta['machine']}. Each column is one `ddp_step.py` run (every hook in one "
              f"process group) on netsim hosts whose links are shaped to that rate each way; "
              f"median of {args.steps} steps after warm-up, in ms; `x@rate` is the speedup over "
              f"dense allreduce at that rate. wire_MB: bytes each rank sends per step.", ""]
        # the cores are shared: say how busy they were at the end of each rate's run
        md += ["Machine at the end of each rate: " + "; ".join(
            f"{label}: {res['meta']['machine'].rsplit(', ', 1)[-1]}" for label, res in results.items()), ""]
        md += [f"Skipped: {what} — {why}" for what, why in meta.get("skipped", [])] + [""]
        md.append(tables.format_table(rows, cols, markdown=True))
        if png:
            md += ["", f"![{os.path.basename(png)}]({os.path.basename(png)})"]
        tables.write_text(args.out + ".md", "\n".join(md) + "\n")
    return rows


if __name__ == "__main__":
    main()
