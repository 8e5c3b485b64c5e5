"""Before/after of a code change in one run: a bench run from two checkouts, alternately.

    python bench/ab_checkouts.py --before REF --after REF --rounds 2 --out bench/results/NAME \\
        -- bench/ddp_step.py -n 2 --netsim 1gbit --interleave 2 --steps 8 --hooks 'default('

Each ref is checked out in a temporary git worktree; the bench command (a ``bench/*.py`` that
writes its table with ``--out``: ddp_step.py, fsdp_step.py) runs from the before checkout, then
the after one, ``--rounds`` times, so the
machine's drift falls on both alike. Per row it compares the step time above the same run's
no-communication floor (``step_ms - floor``: what the change can affect), averaged over the
rounds, and prints ``after / before``. The results file records the command, both commits, the
machine and the load, and every run's rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from harness import machine, tables  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = ("no-comm floor", "local (no comm) floor")

__all__ = ["main"]


def _git(*args) -> str:
    return subprocess.check_output(["git", "-C", ROOT, *args], text=True).strip()


def _run(tree: str, bench: list[str], out: str) -> list[dict]:
    """The bench from ``tree``; its rows (name, step_ms) read back from its markdown table."""
    script = os.path.join(tree, bench[0])
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run([sys.executable, script, *bench[1:], "--out", out], cwd=tree, env=env, check=True)
    with open(out + ".md") as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    name, col = head[0], head.index("step_ms")
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        try:
            rows.append({"hook": cells[0].replace("\\|", "|"), "step_ms": float(cells[col])})
        except (ValueError, IndexError):
            continue
    return rows


def _above_floor(rows: list[dict]) -> dict:
    by = {r["hook"]: r for r in rows}
    floor = next((by[f]["step_ms"] for f in FLOORS if f in by), None)
    return {h: r["step_ms"] - floor for h, r in by.items() if h not in FLOORS and floor is not None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", default="HEAD")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="results file stem (.md)")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- bench/SCRIPT.py ARGS")
    args = p.parse_args(argv)
    bench = [a for a in args.bench if a != "--"]
    refs = {"before": _git("rev-parse", args.before), "after": _git("rev-parse", args.after)}
    load_before = os.getloadavg()
    runs: dict[str, list] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="commpress-ab-") as tmp:
        trees = {}
        for side, sha in refs.items():
            trees[side] = os.path.join(tmp, side)
            _git("worktree", "add", "--detach", "-q", trees[side], sha)
        try:
            for k in range(args.rounds):
                for side in ("before", "after"):
                    runs[side].append(_run(trees[side], bench, os.path.join(tmp, f"{side}{k}")))
        finally:
            for t in trees.values():
                _git("worktree", "remove", "--force", t)
    above = {s: [_above_floor(r) for r in rs] for s, rs in runs.items()}
    hooks = [h for h in above["before"][0] if all(h in a for side in above.values() for a in side)]
    rows = []
    for h in hooks:
        b = statistics.mean(a[h] for a in above["before"])
        a = statistics.mean(a[h] for a in above["after"])
        rows.append({"hook": h, "before_ms": b, "after_ms": a, "after/before": a / b if b else None})
    cols = ["hook", "before_ms", "after_ms", "after/before"]
    print(tables.format_table(rows, cols), flush=True)
    if args.out:
        cmd = " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
        md = [f"# Before/after: {' '.join(bench)}", "", "```", cmd, "```", "",
              f"Before: `{refs['before']}`; after: `{refs['after']}`. Machine: {machine.machine_facts()}.",
              f"Load before: `{load_before}`; after: `{os.getloadavg()}`.", "",
              f"{args.rounds} rounds, each the bench from the before checkout, then the after one. "
              "`before_ms`/`after_ms`: a row's median step minus the same run's no-communication "
              "floor, averaged over the rounds; `after/before`: their ratio.", "",
              tables.format_table(rows, cols, markdown=True), "", "Every run's rows (step_ms):", ""]
        for side, rs in runs.items():
            for k, r in enumerate(rs):
                md.append(f"- {side} {k}: " + ", ".join(f"{x['hook']} {x['step_ms']:.1f}" for x in r
                                                        if isinstance(x.get("step_ms"), (int, float))))
        tables.write_text(args.out + ".md", "\n".join(md) + "\n")
    return rows


if __name__ == "__main__":
    main()
