"""CPU speed of the compressors against one tensor copy, torch.topk and a naive quantizer.

One process, ``--threads`` torch threads (default 1; ``1,2`` gives a table for each), one run: every case is timed in the
same run, round robin (case A, B, C, ..., then again), so load from other processes on the
machine hits all of them alike; each time is the median of ``--reps`` repetitions after one
warm-up call (which allocates the compressors' reused scratch buffers). Wall-clock times are
the headline; the thread's CPU time is reported too, since on a shared machine waiting for a
core inflates wall time (memory-bandwidth contention still shows in both).

Cases on ``--n`` fp32 values (default 25M = 100 MB):

* ``copy``: ``buf.copy_(x)`` into a preallocated buffer, the unit of the ratios;
* ``qsgd8`` / ``qsgd4`` / ``sign``: ``compress`` (fresh payload tensors, as the hook needs)
  + ``decompress_into`` a preallocated fp32 buffer; ``qsgd8 fresh`` decodes with
  ``decompress`` instead (a fresh 100 MB result: page faults included);
* ``naive q8``: 8-bit stochastic quantization written the obvious way in torch (one max-abs
  scale, ``rand_like`` for the rounding) + its decode;
* ``torch.topk``: ``torch.topk(x.abs(), k, sorted=False)`` for k = 1%;
* ``topk approx``: ``TopK(0.01, exact=False).compress`` (sampled threshold) + decode into a
  preallocated buffer; ``topk exact`` is ``TopK(0.01)`` (torch.topk inside) the same way.

Usage::

    python bench/compressor_speed.py                      # print it, write bench/results/compressors.md
    python bench/compressor_speed.py --out ''             # print only
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # for harness; last, so that
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/*.py never shadow packages
import harness  # noqa: E402  (puts the repository root first on sys.path)
from harness.locks import BENCH_LOCK, file_lock  # noqa: E402
from harness.machine import cpu_model  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from compressors import BF16, FP16, QSGD, Context, RandomK, ScaledSign, TopK, cpu_kernels  # noqa: E402

ROOT = harness.ROOT


def naive_q8(x: torch.Tensor):
    """8-bit stochastic quantization the obvious way: temporaries everywhere, rand_like."""
    s = x.abs().max()
    t = x / s * 127.5 + 127.5
    q = (t + torch.rand_like(t)).floor().clamp(0, 255).to(torch.uint8)
    return s, q


def naive_dq8(s, q):
    return q.float() * (2 * s / 255) - s


def cases(n: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g)
    buf = torch.empty_like(x)
    out = torch.empty_like(x)
    k = max(1, n // 100)
    step = [0]

    def ctx():
        step[0] += 1  # a fresh hash stream every call, as in training
        return Context.of(x, step=step[0], rank=1)

    def roundtrip(c):
        def run():
            cx = ctx()
            c.decompress_into(c.compress(x, cx), cx, out)
        return run

    def roundtrip_fresh(c):
        def run():
            cx = ctx()
            c.decompress(c.compress(x, cx), cx)
        return run

    def compress_only(c):
        return lambda: c.compress(x, ctx())

    q8, q4, sg = QSGD(8), QSGD(4), ScaledSign()
    tk, ta = TopK(0.01), TopK(0.01, exact=False)
    f16, b16, rk = FP16(), BF16(), RandomK(0.01)
    return [
        ("copy", "buf.copy_(x), preallocated", lambda: buf.copy_(x)),
        ("qsgd8", f"{q8!r} compress + decompress_into", roundtrip(q8)),
        ("qsgd8 compress", f"{q8!r} compress only", compress_only(QSGD(8))),
        ("qsgd8 fresh", f"{q8!r} compress + decompress (fresh output)", roundtrip_fresh(QSGD(8))),
        ("qsgd4", f"{q4!r} compress + decompress_into", roundtrip(q4)),
        ("sign", f"{sg!r} compress + decompress_into", roundtrip(sg)),
        ("sign compress", f"{sg!r} compress only", compress_only(ScaledSign())),
        ("fp16", f"{f16!r} compress + decompress_into", roundtrip(f16)),
        ("bf16", f"{b16!r} compress + decompress_into", roundtrip(b16)),
        ("randomk", f"{rk!r} compress + decompress_into", roundtrip(rk)),
        ("naive q8", "torch 8-bit, rand_like rounding, + decode",
         lambda: naive_dq8(*naive_q8(x))),
        ("torch.topk", "torch.topk(x.abs(), 1%)", lambda: torch.topk(x.abs(), k, sorted=False)),
        ("topk exact", f"{tk!r} compress + decompress_into", roundtrip(tk)),
        ("topk exact compress", f"{tk!r} compress only", compress_only(TopK(0.01))),
        ("topk approx", f"{ta!r} compress + decompress_into", roundtrip(ta)),
        ("topk approx compress", f"{ta!r} compress only", compress_only(TopK(0.01, exact=False))),
    ]


def measure(n: int, reps: int, only: set | None = None):
    todo = [c for c in cases(n) if not only or c[0] in only or c[0] == "copy"]
    times = {name: [] for name, _, _ in todo}
    cpu = {name: [] for name, _, _ in todo}
    for _, _, fn in todo:  # warm-up: allocates the reused scratch buffers
        fn()
    for _ in range(reps):
        for name, _, fn in todo:
            c0, t0 = time.thread_time(), time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
    return [(name, what, statistics.median(times[name]) * 1e3, min(times[name]) * 1e3,
             statistics.median(cpu[name]) * 1e3) for name, what, _ in todo]


def facts() -> list[str]:
    return [
        f"CPU: {cpu_model()}, nproc {os.cpu_count()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"Python {platform.python_version()}",
        f"torch threads {torch.get_num_threads()} (--threads); compiled CPU kernels: "
        f"{'yes' if cpu_kernels.lib() is not None else 'no (' + str(cpu_kernels.build_error()) + ')'}; "
        f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')} (left as they were)",
    ]


def table(rows) -> tuple[str, dict]:
    copy = next(r[2] for r in rows if r[0] == "copy")
    copy_cpu = next(r[4] for r in rows if r[0] == "copy")
    by = {r[0]: r[2] for r in rows}
    by_cpu = {r[0]: r[4] for r in rows}
    lines = ["| case | what | median ms | min ms | x copy | CPU ms | x copy (CPU) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, what, med, mn, cpu in rows:
        lines.append(f"| {name} | {what} | {med:.1f} | {mn:.1f} | {med / copy:.2f} | "
                     f"{cpu:.1f} | {cpu / copy_cpu:.2f} |")
    ratios = {}
    for name in ("qsgd8", "qsgd4", "sign", "fp16", "bf16", "randomk", "topk exact", "topk approx"):
        if name in by:
            ratios[f"{name} compress+decompress / copy (target <= 3)"] = by[name] / copy
    if "torch.topk" in by and "topk exact compress" in by:
        ratios["torch.topk / TopK(exact) compress (target >= 15)"] = (
            by["torch.topk"] / by["topk exact compress"])
        ratios["TopK(exact) / TopK(exact=False) compress (target <= 1.5)"] = (
            by["topk exact compress"] / by["topk approx compress"])
    if "qsgd8" in by:
        ratios["QSGD 8-bit compress+decompress / copy (target <= 6)"] = by["qsgd8"] / copy
        ratios["QSGD 8-bit, thread CPU time / copy's"] = by_cpu["qsgd8"] / copy_cpu
    if "qsgd4" in by:
        ratios["QSGD 4-bit compress+decompress / copy"] = by["qsgd4"] / copy
    if "sign" in by:
        ratios["sign compress+decompress / copy"] = by["sign"] / copy
    if "naive q8" in by and "qsgd8" in by:
        ratios["naive torch 8-bit / QSGD 8-bit (speedup)"] = by["naive q8"] / by["qsgd8"]
    if "torch.topk" in by and "topk approx compress" in by:
        ratios["torch.topk / TopK(exact=False) compress (target >= 5)"] = (
            by["torch.topk"] / by["topk approx compress"])
        ratios["torch.topk / TopK(exact=False) compress, thread CPU time"] = (
            by_cpu["torch.topk"] / by_cpu["topk approx compress"])
    if "torch.topk" in by and "topk approx" in by:
        ratios["torch.topk / TopK(exact=False) compress+decompress"] = (
            by["torch.topk"] / by["topk approx"])
    return "\n".join(lines), ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=float, default=25e6, help="fp32 values (default 25e6)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions per case (median)")
    ap.add_argument("--only", default="", help="comma-separated case names (copy always runs)")
    ap.add_argument("--out", default=os.path.join(harness.RESULTS, "compressors.md"),
                    help="also write a markdown report here (default bench/results/compressors.md; "
                         "'' for none)")
    ap.add_argument("--threads", default="1", help="comma-separated torch thread counts, "
                    "each a full table (default 1)")
    ap.add_argument("--no-lock", action="store_true", help=f"do not wait for {BENCH_LOCK}")
    args = ap.parse_args(argv)
    n = int(args.n)
    only = {s.strip() for s in args.only.split(",") if s.strip()} or None
    cmd = "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv or sys.argv[1:]))
    report = ["# Compressor speed on CPU\n", f"Command (repository root):\n\n```\n{cmd}\n```\n"]
    with contextlib.nullcontext() if args.no_lock else file_lock(BENCH_LOCK):
        for nt in [int(v) for v in args.threads.split(",")]:
            torch.set_num_threads(nt)
            load0 = os.getloadavg()[0]
            t0 = time.time()
            rows = measure(n, args.reps, only)
            load1 = os.getloadavg()[0]
            tbl, ratios = table(rows)
            head = facts() + [
                f"n = {n} fp32 values ({n * 4 / 1e6:.0f} MB), median of {args.reps} after a warm-up, "
                f"cases interleaved; {time.time() - t0:.0f} s; 1-min load average {load0:.1f} at the "
                f"start, {load1:.1f} at the end (other processes share the cores)",
            ]
            ratio_lines = [f"{k}: {v:.2f}" for k, v in ratios.items()]
            print(f"## {nt} torch thread(s)")
            print("\n".join("# " + h for h in head))
            print(tbl)
            print("\n".join(ratio_lines))
            report += [f"## {nt} torch thread(s)\n", "\n".join(f"- {h}" for h in head) + "\n", tbl + "\n",
                       "Ratios (medians):\n\n" + "\n".join(f"- {r}" for r in ratio_lines) + "\n"]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
