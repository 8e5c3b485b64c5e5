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
``relerr`` ``||out - ref|| / ||ref||``. The floors measured in the same run: ``raw`` (us) is
one plain allreduce that makes each rank send ``wire_B`` (the link-rate transfer time of the
row's bytes), ``codec`` (us) the same algorithm on a
:class:`~comms.transport.communicator.LoopbackCommunicator` (all its CPU work — codec, glue, decoding
``W`` payloads — with nothing on the wire), ``floor_x = time / (raw + codec)``.

``--transport`` adds raw transport rows (no codec): gloo's own allgather / all_to_all /
allreduce and commpress's pipelined point-to-point exchange
(:mod:`comms.transport.pipelined_exchange`) of ``size / 4`` bytes per rank (a 4x-compressed payload),
their ``wire_B`` what each rank sends.

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
                  "compressor", "algorithm", "wire_B", "ratio", "relerr", "raw", "codec", "floor_x")
# the transport rows of --transport: (label, how) for one payload of `size` bytes per rank
TRANSPORTS = ("gloo allgather", "pipelined allgather", "gloo all_to_all", "pipelined all_to_all",
              "gloo allreduce")
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
    p.add_argument("--transport", action="store_true",
                   help="also time raw transports (gloo's collectives vs the pipelined exchange)")
    p.add_argument("--no-floors", dest="floors", action="store_false",
                   help="skip the raw and codec floor columns")
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


def _timed(fn, iters: int) -> float:
    """Mean seconds of ``fn()`` over ``iters`` calls after one warm-up."""
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def raw_allreduce_us(comm, wire_bytes: int, iters: int) -> float:
    """Max over ranks of one plain allreduce that sends ``wire_bytes`` per rank (ring:
    ``2 (W-1)/W`` of the buffer), in microseconds."""
    world = comm.world_size
    buf = torch.zeros(max(1, wire_bytes * world // (2 * (world - 1)) // 4))
    comm.all_reduce(torch.zeros(1)).wait()
    return _max_over_ranks(comm, _timed(lambda: comm.all_reduce(buf).wait(), iters)) * 1e6


def codec_alone_us(comm, alg, c, x, seed: int, iters: int) -> float:
    """Max over ranks of the algorithm's CPU work alone: the same call on a
    :class:`~comms.transport.communicator.LoopbackCommunicator` of this world size."""
    import compressors
    from comms.transport.communicator import LoopbackCommunicator

    loop = LoopbackCommunicator(comm.world_size, comm.rank)
    store: dict = {}
    step = [0]

    def once():
        step[0] += 1
        ctx = compressors.Context(numel=x.numel(), step=step[0], bucket=0, rank=comm.rank, seed=seed)
        alg(loop, c, x, ctx, store).wait()

    return _max_over_ranks(comm, _timed(once, iters)) * 1e6


def transport_rows(comm, size: int, iters: int) -> list[tuple[str, float, int]]:
    """``(label, us, bytes sent per rank)`` of each raw transport of ``size // 4`` bytes."""
    import torch.distributed as dist
    from comms.transport.communicator import _AG
    from comms.transport.pipelined_exchange import PipelinedExchange

    world = comm.world_size
    n = max(world, size // 4 // world * world)
    x = torch.full((n,), comm.rank % 251, dtype=torch.uint8)
    out = torch.empty(world * n, dtype=torch.uint8)
    group = getattr(comm, "group", None)
    ex = PipelinedExchange(group, comm.rank, world)
    runs = {
        "gloo allgather": lambda: _AG(out, x, group=group),
        "pipelined allgather": lambda: ex.all_gather(x).wait(),
        "gloo all_to_all": lambda: dist.all_to_all_single(out[:n], x, group=group),
        "pipelined all_to_all": lambda: ex.all_to_all(x).wait(),
        "gloo allreduce": lambda: dist.all_reduce(x.view(torch.int8)[: n // 2 * 2], group=group),
    }
    sent = {"gloo allgather": (world - 1) * n, "pipelined allgather": (world - 1) * n,
            "gloo all_to_all": (world - 1) * n // world, "pipelined all_to_all": (world - 1) * n // world,
            "gloo allreduce": 2 * (world - 1) * (n // 2 * 2) // world}
    rows = []
    for label in TRANSPORTS:
        comm.all_reduce(torch.zeros(1)).wait()
        rows.append((label, _max_over_ranks(comm, _timed(runs[label], iters)) * 1e6, sent[label]))
    ex.stop()
    return rows


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
        f"{'wire_B':>12}  {'ratio':>6}  {'relerr':>9}  {'raw':>8}  {'codec':>8}  {'floor_x':>7}")
    say(f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>7}  "
        f"{'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}  {'':>24}  {'':>12}  {'':>12}  {'':>6}  {'':>9}  "
        f"{'(us)':>8}  {'(us)':>8}")
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
            raw_us = codec_us = float("nan")
            if args.floors and getattr(comm, "backend", "") != "loopback":
                raw_us = raw_allreduce_us(comm, wire, args.iters)
                codec_us = 0.0 if c is None else codec_alone_us(comm, alg, c, xs[rank], args.seed, args.iters)
            floor_x = t_us / (raw_us + codec_us)
            row = {"size": nbytes, "count": count, "type": "float", "redop": "sum", "root": -1,
                   "time_us": t_us, "algbw": algbw, "busbw": busbw, "wrong": wrong,
                   "compressor": spec, "algorithm": name, "wire_bytes": wire,
                   "ratio": dense_b / wire if wire else float("inf"), "relerr": relerr, "world": world,
                   "raw_us": raw_us, "codec_us": codec_us, "floor_x": floor_x,
                   "backend": comm.backend}
            rows.append(row)
            busbw_sum += busbw
            nbw += 1
            wrong_total += max(wrong, 0)
            say(f"  {nbytes:>10}  {count:>12}  {'float':>8}  {'sum':>6}  {-1:>6}  {t_us:>7.0f}  "
                f"{algbw:>6.3f}  {busbw:>6.3f}  {wrong if args.check else 'N/A':>6}  {spec:>24}  "
                f"{name:>12}  {wire:>12}  {row['ratio']:>6.2f}  {relerr:>9.2e}  {raw_us:>8.0f}  "
                f"{codec_us:>8.0f}  {floor_x:>7.2f}")
        if args.transport and comm.backend == "gloo":
            for label, us, sent in transport_rows(comm, nbytes, args.iters):
                rows.append({"size": nbytes // 4, "time_us": us, "compressor": "raw", "algorithm": label,
                             "wire_bytes": sent, "world": world, "backend": comm.backend})
                say(f"  {nbytes // 4:>10}  {nbytes // 4:>12}  {'uint8':>8}  {'-':>6}  {-1:>6}  {us:>7.0f}  "
                    f"{nbytes / 4 / us / 1e3:>6.3f}  {'-':>6}  {'-':>6}  {'raw':>24}  {label:>12}  {sent:>12}")
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
    from comms.cluster.launch_env import launch_info, mpi_launched

    info = launch_info()
    if info is not None and info.launcher == "torchrun" and "MASTER_ADDR" in os.environ:
        from comms import TorchCommunicator
        from comms.cluster.launch import init_from_env

        init_from_env("gloo", timeout_s=600)
        run(TorchCommunicator(), args)
    elif mpi_launched():
        if args.backend == "gloo":
            from comms import TorchCommunicator
            from comms.cluster.mpi import init_torch_from_mpi

            init_torch_from_mpi(timeout_s=600)
            run(TorchCommunicator(), args)
        else:
            from comms.cluster.mpi import MPICommunicator

            comm = MPICommunicator()
            run(comm, args)
            comm.close()
    else:
        from comms.cluster.launch import spawn

        if args.nranks < 2:
            raise SystemExit("-g/--nranks must be >= 2 when self-spawning")
        spawn(_spawned, args.nranks, argv, timeout=3600, env={"COMMPRESS_THREADS": str(args.threads)})


if __name__ == "__main__":
    main()
