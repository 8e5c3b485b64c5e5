"""Run a DDP bench's rank body under whatever launched the process.

The DDP benches run the same way under every launcher:

* ``torchrun --nproc-per-node N bench/x.py ...`` and ``mpirun -n N python bench/x.py ...``:
  rank and world from the environment (:mod:`comms.cluster.launch_env`); under MPI the rendezvous
  port is broadcast with mpi4py when it is installed, else ``MASTER_PORT`` or 29500;
* ``python bench/x.py -n N ...`` self-spawns N gloo ranks with :func:`comms.cluster.launch.spawn`;
* ``python bench/x.py --netsim RATE -n N ...`` (root) builds N shaped hosts with netsim, one
  rank per host, and runs ``netsim exec K python bench/x.py --rank K ...`` in each.

Self-spawned and netsim runs hold ``BENCH_LOCK`` unless ``--no-lock``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
from typing import Any, Callable, Sequence

from . import ROOT
from .locks import BENCH_LOCK, file_lock
from .machine import threads_for
from .netsim import NetsimRank, rendezvous_port, run_on_hosts

__all__ = ["add_launch_args", "init_distributed", "launch", "launch_recorded", "netsim_run", "strip_flags",
           "shell_command"]


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every DDP bench."""
    p.add_argument("-n", "--nprocs", type=int, default=2,
                   help="ranks to self-spawn (ignored under torchrun/mpirun)")
    p.add_argument("--netsim", metavar="RATE", default=None,
                   help="run each rank on its own netsim host with links shaped to RATE "
                        "(e.g. 1gbit, 500mbit); needs root")
    # how a netsim parent tells its children who they are
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--master-port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-lock", action="store_true",
                   help=f"do not serialize on {BENCH_LOCK} (the netsim lock is always taken)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before every rank is killed")


def init_distributed(rank: int, world: int, launcher: str, master_port: int | None = None,
                     timeout_s: float = 600.0, local_size: int | None = None):
    """``init_process_group("gloo")`` for an env- or netsim-launched rank, with the cores of
    the host shared evenly among its ``local_size`` ranks (default: all ``world`` ranks)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from comms.cluster.launch import free_port
    from comms.cluster.launch_env import MPI_LAUNCHERS

    if dist.is_initialized():
        return
    addr = os.environ.get("MASTER_ADDR") or os.environ.get("NETSIM_MASTER") or "127.0.0.1"
    port = master_port or os.environ.get("MASTER_PORT")
    if port is None and launcher in MPI_LAUNCHERS:
        try:  # every rank must agree on one port: rank 0 picks, MPI broadcasts
            from mpi4py import MPI

            port = MPI.COMM_WORLD.bcast(free_port() if rank == 0 else None, root=0)
        except ImportError:
            port = 29500
    port = int(port or 29500)
    os.environ.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    torch.set_num_threads(threads_for(local_size or world))
    # x86 CPUs take ~100x longer on subnormal floats (GPUs flush them): a run that drifts into
    # them (charlm12m under the outer sync: 0.4 -> 0.9 s a step by step 200) would time the CPU's
    # slow path, not the communication. Every row and floor of every bench flushes them alike.
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))


def launch(script: str, body: Callable[..., Any], args, argv: Sequence[str]) -> Any:
    """Run ``body(rank, world, args)`` under whatever launched this process.

    Returns rank 0's result in-process for env/netsim-child launches (``None`` on other
    ranks), the list of per-rank results when self-spawned, and ``None`` for a netsim parent
    (the rank processes print and write the results themselves).
    """
    import torch.distributed as dist

    from comms.cluster.launch_env import launch_info

    if args.rank is not None:  # a netsim child: netsim hosts share this machine's cores
        init_distributed(args.rank, args.world, "netsim", args.master_port, args.timeout)
        try:
            return body(args.rank, args.world, args)
        finally:
            dist.destroy_process_group()
    info = launch_info()
    if info is not None:
        init_distributed(info.rank, info.world_size, info.launcher, None, args.timeout,
                         local_size=info.local_size)
        try:
            return body(info.rank, info.world_size, args)
        finally:
            dist.destroy_process_group()
    lock = contextlib.nullcontext() if args.no_lock else file_lock(BENCH_LOCK, "(bench)")
    with lock:
        if args.netsim:
            passthrough = strip_flags(argv, {"--netsim": 1, "-n": 1, "--nprocs": 1})
            return netsim_run(script, passthrough, args.nprocs, args.netsim, args.timeout)
        from comms.cluster.launch import spawn

        env = {"COMMPRESS_THREADS": str(threads_for(args.nprocs))}
        return spawn(body, args.nprocs, args, timeout=args.timeout, env=env)


def netsim_run(script: str, argv: Sequence[str], world: int, rate: str,
               timeout: float = 1800.0, stdout=None) -> int:
    """Run ``world`` ranks of ``script`` on netsim hosts shaped to ``rate``; one rank per host.

    Rank k runs ``python script --rank k --world N --master-port P --no-lock argv...``; only
    rank 0's stdout is kept (to ``stdout``; ``None``: this process's). Returns 0, or raises
    ``RuntimeError`` (see :func:`harness.netsim.run_on_hosts`).
    """
    port = rendezvous_port()
    ranks = [NetsimRank(k, [sys.executable, script, "--rank", str(k), "--world", str(world),
                            "--master-port", str(port), "--no-lock", *argv],
                        stdout=stdout if k == 0 else subprocess.DEVNULL)
             for k in range(world)]
    run_on_hosts(world, rate, ranks, timeout)
    return 0


def strip_flags(argv: Sequence[str], flags: dict[str, int]) -> list[str]:
    """``argv`` without ``flags`` (flag -> number of values it takes; ``--flag=value`` too)."""
    out, i = [], 0
    argv = list(argv)
    while i < len(argv):
        a = argv[i]
        key = a.split("=", 1)[0]
        if key in flags:
            i += 1 if "=" in a else 1 + flags[key]
            continue
        out.append(a)
        i += 1
    return out


def shell_command(argv: Sequence[str]) -> str:
    """The command line that reproduces this run, for results files."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return " ".join(["python", shlex.quote(script), *map(shlex.quote, argv)])


def launch_recorded(script: str, body, args, argv: list[str]):
    """:func:`launch` with the command line and the link rate recorded in
    ``args`` (and passed on to netsim children, which cannot see the parent's argv), for the
    results files of the DDP and FSDP step benches."""
    if args.command is None:
        args.command = shell_command(argv)
        argv = [*argv, "--command", args.command]
    if args.link is None:
        args.link = args.netsim or "unshaped"
        argv = [*argv, "--link", args.link]
    return launch(script, body, args, argv)
