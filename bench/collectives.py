"""nccl-tests-style bench of the compressed collectives (allreduce of a float buffer, sum).

Columns (the first ones exactly as nccl-tests' all_reduce_perf prints them)::

    size count type redop root | time algbw busbw #wrong | compressor algorithm wire_B ratio relerr

``size`` bytes, ``count`` elements, ``time`` microseconds (max over ranks of the mean per
iteration), ``algbw = size / time`` and ``busbw = algbw * 2(n-1)/n`` in GB/s (1e9) — computed
from the *uncompressed* size, so ``busbw`` is the effective bus bandwidth and columns of
different compressors compare directly. ``#wrong`` counts elements whose error against a
dense fp64 reference is outside the algorithm's bound (the sum of per-rank compressor
bounds; two-phase adds the owner's re-compression bound; shared-scale one shared-scale step
per rank; plus fp slack). ``wire_B`` is bytes sent per rank, ``ratio`` dense/wire bytes,
``relerr`` ``||out - ref|| / ||ref||``.

Runs three ways::

    torchrun --nproc_per_node 4 bench/collectives.py -b 1M -e 64M -f 4 --compressor qsgd:bits=8
    mpirun -n 4 python bench/collectives.py -b 1M -e 64M --algorithm two_phase   # MPI backend
    python bench/collectives.py -g 4 -b 1M -e 64M                                 # self-spawned gloo

``--compressor`` is repeatable or a comma list (``none`` or ``dense`` is the plain
allreduce); ``--algorithm`` likewise (default: the compressor's cheapest family);
unsupported pairs are skipped with a ``#`` line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # for harness; last, so that
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/*.py never shadow packages
import harness  # noqa: E402,F401  (puts the repository root first on sys.path)

import torch  # noqa: E402

__all__ = ["main", "parse_size", "split_specs", "HEADER_COLUMNS"]

logger = logging.getLogger(__name__)

HEADER_COLUMNS = ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                  "compressor", "algorithm", "wire_B", "ratio", "relerr")
_DENSE = ("none", "dense")
_PREFERENCE = ("allreduce", "allgather", "two_phase", "shared_scale")  # cheapest family first
_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864 (K/M/G binary suffixes, as nccl-tests)."""
    t = str(text).strip().upper().rstrip("B")
    mult = 1
    if t and t[-1] in _SUFFIX:
        mult, t = _SUFFIX[t[-1]], t[:-1]
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 8, 64K, 100M, 1G)") from None
    if value < 4:
        raise argparse.ArgumentTypeError(f"size must be >= 4 bytes, got {text!r}")
    return value


def split_specs(values) -> list[str]:
    """Repeated/comma-listed specs; ``key=value`` pieces without a name join the previous spec."""
    out: list[str] = []
    for v in values or []:
        for piece in filter(None, (p.strip() for p in v.split(","))):
            if out and "=" in piece and ":" not in piece.split("=")[0] and out[-1] not in _DENSE:
                out[-1] += "," + piece
            else:
                out.append(piece)
    return out


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1M"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("-w", "--warmup_iters", type=int, default=2)
    p.add_argument("-c", "--check", type=int, default=1, help="count #wrong (1) or not (0)")
    p.add_argument("-g", "--nranks", type=int, default=2, help="ranks to self-spawn when run alone")
    p.add_argument("--compressor", action="append", help="spec; repeatable or comma list")
    p.add_argument("--algorithm", action="append", help="algorithm name; repeatable or comma list")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--backend", choices=("gloo", "mpi"), default=None,
                   help="under mpirun: mpi (default) or gloo; otherwise gloo")
    p.add_argument("--threads", type=int, default=int(os.environ.get("COMMPRESS_THREADS", "1")),
                   help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.stepfactor < 2:
        p.error("-f must be >= 2")
    if a.iters < 1 or a.warmup_iters < 0:
        p.error("-n must be >= 1 and -w >= 0")
    return a


def _cases(args):
    import compressors
    from comms.algorithms import ALGORITHMS, get_algorithm

    specs = split_specs(args.compressor) or ["none"]
    algs = split_specs(args.algorithm)
    for a in algs:
        get_algorithm(a)  # ValueError naming the bad name, before any communication
    cases, skipped = [], []
    for spec in specs:
        if spec.lower() in _DENSE:
            cases.append((None, "allreduce"))
            continue
        c = compressors.from_spec(spec)
        names = algs or [next(a for a in _PREFERENCE if c.supports(a) and a in ALGORITHMS)]
        for a in names:
            if c.supports(ALGORITHMS[a].family):
                cases.append((c, a))
            else:
                skipped.append(f"{c.spec()} via {a}")
    return cases, skipped


def _inputs(rank, world, count, seed, all_ranks):
    ranks = range(world) if all_ranks else [rank]
    xs = {}
    for r in ranks:
        g = torch.Generator().manual_seed(seed * 1_000_003 + r)
        xs[r] = torch.randn(count, generator=g)
    return xs


def _bound(alg, c, xs):
    world = len(xs)
    absx = sum(x.double().abs() for x in xs)
    if c is None:
        return (world + 2) * torch.finfo(torch.float32).eps * absx
    if hasattr(alg, "error_bound"):
        return alg.error_bound(c, xs)
    b = sum(c.error_bound(x).double() for x in xs)
    eps = torch.finfo(getattr(c, "wire_dtype", torch.float32)).eps
    return b + (world + 2) * eps * (absx + b)


def _max_over_ranks(comm, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    return float(comm.all_gather(t).wait().max())


def run(comm, args, out=sys.stdout):
    """The bench body on every rank; rank 0 prints. Returns the rows (rank 0) or []."""
    import compressors
    from comms.algorithms import get_algorithm

    torch.set_num_threads(max(1, args.threads))
    rank, world = comm.rank, comm.world_size
    cases, skipped = _cases(args)
    say = (lambda s: print(s, file=out, flush=True)) if rank == 0 else (lambda s: None)
    say(f"# nThread 1 nGpus 1 minBytes {args.minbytes} maxBytes {args.maxbytes} step: "
        f"{args.stepfactor}(factor) warmup iters: {args.warmup_iters} iters: {args.iters} "
        f"agg iters: 1 validation: {args.check} graph: 0")
    say("#")
    say(f"# Using devices (backend {comm.backend}, {world} ranks, torch threads {args.threads})")
    hosts = [socket.gethostname()]
    say(f"#  Rank  0 Group  0 Pid {os.getpid():>6} on {hosts[0]:>10} device  0 [cpu]")
    for s in skipped:
        say(f"# skipped (family not supported): {s}")
    say("#")
    say(f"# {'':>60}out-of-place")
    say(f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  {'time':>7}  "
        f"{'algbw':>6}  {'busbw':>6}  {'#wrong':>6}  {'compressor':>24}  {'algorithm':>12}  "
        f"{'wire_B':>12}  {'ratio':>6}  {'relerr':>9}")
    say(f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>7}  "
        f"{'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}")
    rows = []
    size = args.minbytes
    sizes = []
    while size <= args.maxbytes:
        sizes.append(size)
        size *= args.stepfactor
    busbw_sum, nbw, wrong_total = 0.0, 0, 0
    for size in sizes:
        count = max(1, size // 4)
        nbytes = count * 4
        xs = _inputs(rank, world, count, args.seed, args.check > 0)
        ref = sum(xs[r].double() for r in range(world)) if args.check else None
        work = torch.empty(count)
        for c, name in cases:
            alg = get_algorithm(name)
            store: dict = {}

            def once(step):
                if c is None:  # the dense baseline: comm.all_reduce in place
                    work.copy_(xs[rank])
                    t0 = time.perf_counter()
                    res = comm.all_reduce(work).wait()
                    return time.perf_counter() - t0, res
                ctx = compressors.Context(numel=count, step=step, bucket=0, rank=rank, seed=args.seed)
                t0 = time.perf_counter()
                res, _own = alg(comm, c, xs[rank], ctx, store).wait()
                return time.perf_counter() - t0, res

            comm.all_reduce(torch.zeros(1)).wait()  # line the ranks up
            _, first = once(0)
            wrong, relerr = -1, float("nan")
            if args.check:
                bound = _bound(alg, c, [xs[r] for r in range(world)])
                diff = (first.double() - ref).abs()
                wrong = int((diff > bound).sum())
                relerr = float(diff.norm() / ref.norm())
            del first
            for it in range(1, args.warmup_iters):
                once(it)
            comm.all_reduce(torch.zeros(1)).wait()
            total = 0.0
            for it in range(args.iters):
                dt, _ = once(args.warmup_iters + it)
                total += dt
            t_us = _max_over_ranks(comm, total / args.iters) * 1e6
            wrong = int(_max_over_ranks(comm, float(wrong)))
            algbw = nbytes / t_us / 1e3
            busbw = algbw * 2 * (world - 1) / world
            dense_b = 2 * (world - 1) * nbytes // world
            wire = dense_b if c is None else alg.wire_bytes(c, count, torch.float32, world)
            spec = "dense" if c is None else c.spec()
            row = {"size": nbytes, "count": count, "type": "float", "redop": "sum", "root": -1,
                   "time_us": t_us, "algbw": algbw, "busbw": busbw, "wrong": wrong,
                   "compressor": spec, "algorithm": name, "wire_bytes": wire,
                   "ratio": dense_b / wire if wire else float("inf"), "relerr": relerr, "world": world,
                   "backend": comm.backend}
            rows.append(row)
            busbw_sum += busbw
            nbw += 1
            wrong_total += max(wrong, 0)
            say(f"  {nbytes:>10}  {count:>12}  {'float':>8}  {'sum':>6}  {-1:>6}  {t_us:>7.0f}  "
                f"{algbw:>6.3f}  {busbw:>6.3f}  {wrong if args.check else 'N/A':>6}  {spec:>24}  "
                f"{name:>12}  {wire:>12}  {row['ratio']:>6.2f}  {relerr:>9.2e}")
        del xs, ref
    say(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}")
    say(f"# Avg bus bandwidth    : {busbw_sum / max(nbw, 1):.6g}")
    say("#")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows if rank == 0 else []


def _spawned(rank, world, argv):
    from comms import TorchCommunicator
    return run(TorchCommunicator(), _args(argv))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    from comms.launch_env import launch_info, mpi_launched

    info = launch_info()
    if info is not None and info.launcher == "torchrun" and "MASTER_ADDR" in os.environ:
        from comms import TorchCommunicator
        from comms.launch import init_from_env

        init_from_env("gloo", timeout_s=600)
        run(TorchCommunicator(), args)
    elif mpi_launched():
        if args.backend == "gloo":
            from comms import TorchCommunicator
            from comms.mpi import init_torch_from_mpi

            init_torch_from_mpi(timeout_s=600)
            run(TorchCommunicator(), args)
        else:
            from comms.mpi import MPICommunicator

            comm = MPICommunicator()
            run(comm, args)
            comm.close()
    else:
        from comms.launch import spawn

        if args.nranks < 2:
            raise SystemExit("-g/--nranks must be >= 2 when self-spawning")
        spawn(_spawned, args.nranks, argv, timeout=3600, env={"COMMPRESS_THREADS": str(args.threads)})


if __name__ == "__main__":
    main()
