"""Stuck / dead rank table: seconds until each survivor's ``backward()`` raises.

Runs every case of ``tests/dist/stuck_ranks.py`` (each algorithm, ``auto`` before, during and
after tuning) with one of 3 gloo ranks SIGSTOPped and SIGKILLed at a seeded step and point,
and prints a markdown table: spec/algorithm x phase x fault -> seconds on each survivor
(``hung``: no raise within pg timeout + slack; ``setup``: the ranks never reached the fault
within the set-up timeout -- not measured, not a hang). Set-up runs at ``--setup-timeout``;
the bound is ``--pg-timeout`` from the fault window on.

Example::

    flock /tmp/bench.lock python bench/stuck_rank.py --pg-timeout 5 --seed 0
    PYTHONPATH=. python bench/stuck_rank.py --only "topk auto" --spy   # py-spy dump of hung ranks
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from dist.stuck_ranks import CASES, format_table, run_one  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pg-timeout", type=float, default=5.0)
    ap.add_argument("--setup-timeout", type=float, default=240.0)
    ap.add_argument("--slack", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="substring of the case label")
    ap.add_argument("--phase", default=None, help="substring of the phase")
    ap.add_argument("--how", default="stop,kill")
    ap.add_argument("--spy", action="store_true", help="py-spy dump hung survivors")
    a = ap.parse_args()
    print(f"load average at the start {os.getloadavg()}", flush=True)
    rows = []
    for case in CASES:
        if a.only and a.only not in case.label or a.phase and a.phase not in case.phase:
            continue
        for how in a.how.split(","):
            out = run_one(case, how, pg_timeout=a.pg_timeout, slack=a.slack,
                          setup_timeout=a.setup_timeout, seed=a.seed, spy=a.spy)
            rows.append((case, how, out))
            print(format_table([rows[-1]]).splitlines()[-1], flush=True)
            if out["setup"]:
                print(f"    set-up did not finish:\n{out['setup']}", flush=True)
            for r, o in out["survivors"].items():
                if o is not None and o.get("msg"):
                    print(f"    rank {r}: {o['type']}: {o['msg'][:600]}", flush=True)
                elif o is not None and o.get("error"):
                    print(f"    rank {r} failed:\n{o['error']}", flush=True)
            for r, dump in out["hung"].items():
                print(f"    rank {r} hung:\n{dump}", flush=True)
    print()
    print(f"pg timeout {a.pg_timeout:g} s, slack {a.slack:g} s, set-up timeout {a.setup_timeout:g} s, "
          f"seed {a.seed}, load average at the end {os.getloadavg()}")
    print(format_table(rows))


if __name__ == "__main__":
    main()
