"""Shared helpers of the benches in ``bench/``: launching, hook configurations, netsim, tables.

The DDP benches run the same way under every launcher:

* ``torchrun --nproc-per-node N bench/x.py ...`` and ``mpirun -n N python bench/x.py ...``
  (rank and world from the environment; under MPI the rendezvous port is broadcast with mpi4py
  when it is installed, else ``MASTER_PORT`` or 29500);
* ``python bench/x.py -n N ...`` self-spawns N gloo ranks with :func:`comms.launch.spawn`;
* ``python bench/x.py --netsim RATE -n N ...`` (root) builds N shaped hosts with netsim, one
  rank per host, and runs ``netsim exec K python bench/x.py --rank K ...`` in each.

Hook configurations are data-driven: :func:`hook_configs` lists every configuration that the
installed ``comms.ALGORITHMS`` and ``compressors.REGISTRY`` can build (and says which it skipped
and why), so algorithms and compressors added later show up without editing the benches.

Example::

    >>> from _common import hook_configs
    >>> configs, skipped = hook_configs()
    >>> [c.name for c in configs][:3]
    ['dense', 'torch-fp16', 'torch-psgd-r1']
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Iterable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the repository root goes first: bench/ (the script's directory, sys.path[0]) holds modules
# such as bench/compressors.py that would otherwise shadow the packages of the same name
if sys.path[:1] != [ROOT]:
    while ROOT in sys.path:
        sys.path.remove(ROOT)
    sys.path.insert(0, ROOT)

__all__ = [
    "ROOT", "RESULTS", "HookConfig", "hook_configs", "filter_configs", "attach_hook",
    "dense_wire_bytes", "torch_powersgd_wire_bytes", "env_rank_world", "init_distributed",
    "threads_for", "find_netsim", "file_lock", "netsim_run", "launch", "add_launch_args",
    "progress", "format_table", "write_csv", "write_text", "machine_facts", "free_port",
    "shell_command", "config_wire_bytes", "config_algorithm", "BENCH_LOCK", "NETSIM_LOCK",
]

logger = logging.getLogger(__name__)

RESULTS = os.path.join(ROOT, "bench", "results")
BENCH_LOCK = "/tmp/bench.lock"
NETSIM_LOCK = "/tmp/netsim.lock"


# -- hook configurations -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HookConfig:
    """One way of averaging gradients in DDP.

    Attributes:
        name: short label used in tables and plots.
        kind: ``"dense"`` (DDP's own allreduce, no hook), ``"torch-fp16"``,
            ``"torch-powersgd"`` or ``"ours"`` (a commpress hook).
        spec: compressor spec for ``"ours"``.
        algorithm: aggregation algorithm for ``"ours"`` (``None``: the state's default).
        error_feedback: for ``"ours"``; ``None`` lets the state decide.
        rank: PowerSGD matrix rank for ``"torch-powersgd"``.
    """

    name: str
    kind: str
    spec: str | None = None
    algorithm: str | None = None
    error_feedback: bool | None = None
    rank: int = 0


# Our compressors in the benches: (spec, error feedback, which algorithms). "each" means every
# registered algorithm whose family the compressor supports; "first" only its preferred one.
# Compressors or algorithms that are not installed are skipped with the reason printed.
OURS = (
    ("topk:density=0.01,exact=false", True, "each"),
    ("qsgd:bits=8", None, "each"),
    ("qsgd:bits=4", None, "each"),
    ("sign", True, "each"),
    ("randomk:density=0.01", True, "first"),
    ("fp16", None, "first"),
    ("powersgd:rank=1", None, "first"),
    ("powersgd:rank=4", None, "first"),
)
# compressors given to the cost-model planner (``algorithm="auto"``, issue 4): it picks dense
# or a compressed algorithm per bucket, so it should never be much slower than dense
AUTO_SPECS = ("qsgd:bits=8", "powersgd:rank=1", "topk:density=0.01,exact=false")
AUTO_ALGORITHMS = ("auto",)


def _short(spec: str, ef: bool | None) -> str:
    """``"topk:density=0.01,exact=false"`` -> ``"topk1%"``; ``"qsgd:bits=4"`` -> ``"qsgd4"``."""
    import compressors

    name, kw = compressors.parse_spec(spec)
    if "density" in kw:
        label = f"{name}{kw['density'] * 100:g}%"
    elif "bits" in kw:
        label = f"{name}{kw['bits']}"
    elif "rank" in kw:
        label = f"{name}-r{kw['rank']}"
    else:
        label = name
    return label + ("+ef" if ef else "")


def _try_state(spec: str, algorithm: str | None, ef: bool | None):
    """Build a CompressionState without a process group; returns (state, None) or (None, why)."""
    import comms

    try:
        return comms.CompressionState(spec, None, algorithm=algorithm, error_feedback=ef), None
    except (ValueError, TypeError, KeyError) as e:
        return None, str(e).splitlines()[0]


def hook_configs(torch_hooks: bool = True, ours: Sequence = OURS,
                 auto: bool = True, auto_specs: Sequence = AUTO_SPECS
                 ) -> tuple[list[HookConfig], list[tuple[str, str]]]:
    """Every hook configuration this installation can run, and what was skipped and why.

    Returns:
        ``(configs, skipped)``; ``skipped`` is a list of ``(what, reason)``.
    """
    import comms
    import compressors

    configs = [HookConfig("dense", "dense")]
    skipped: list[tuple[str, str]] = []
    if torch_hooks:
        configs += [HookConfig("torch-fp16", "torch-fp16"),
                    HookConfig("torch-psgd-r1", "torch-powersgd", rank=1),
                    HookConfig("torch-psgd-r4", "torch-powersgd", rank=4)]
    algs = []
    for a, fn in comms.ALGORITHMS.items():
        if a in AUTO_ALGORITHMS:
            continue
        if getattr(fn, "hierarchical", False):  # needs a tiered (multi-node) communicator
            skipped.append((f"* @ {a}", "hierarchical: needs several ranks per node; these benches "
                                        "run one rank per (simulated) host, where it equals the flat form"))
            continue
        algs.append(a)
    for spec, ef, which in ours:
        name = compressors.parse_spec(spec)[0]
        if name not in compressors.REGISTRY:
            skipped.append((spec, f"compressor {name!r} not in compressors.REGISTRY"))
            continue
        ef_label = ef if ef is not None else None
        if which == "first":
            st, why = _try_state(spec, None, ef)
            if st is None:
                skipped.append((spec, why))
                continue
            ef_label = st.error_feedback
            configs.append(HookConfig(f"{_short(spec, ef_label)}@{st.algorithm}", "ours", spec,
                                      st.algorithm, ef))
            continue
        for alg in algs:
            st, why = _try_state(spec, alg, ef)
            if st is None:
                skipped.append((f"{spec} @ {alg}", why))
                continue
            configs.append(HookConfig(f"{_short(spec, st.error_feedback)}@{alg}", "ours", spec,
                                      alg, ef))
    if auto:
        for spec in auto_specs:
            st, why = _try_state(spec, "auto", None)
            if st is None:
                skipped.append((f"auto({spec})", why))
                continue
            configs.append(HookConfig(f"auto({_short(spec, st.error_feedback)})", "ours", spec,
                                      "auto", None))
    return configs, skipped


def filter_configs(configs: list[HookConfig], patterns: str | None) -> list[HookConfig]:
    """Keep configs whose name contains one of the comma-separated ``patterns``; dense stays."""
    if not patterns:
        return configs
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    keep = [c for c in configs if c.kind == "dense" or any(p == c.name or p in c.name for p in pats)]
    unknown = [p for p in pats if not any(p == c.name or p in c.name for c in configs)]
    if unknown:
        raise ValueError(f"--hooks {unknown} match no configuration; available: "
                         f"{[c.name for c in configs]}")
    return keep


def attach_hook(ddp, cfg: HookConfig, process_group=None, start_iter: int = 2, optimizer=None,
                **hook_kwargs):
    """Register ``cfg`` on a fresh DDP wrapper; returns the hook state (``None`` for dense).

    ``optimizer``: given to ``comms.register`` for our hooks (it takes SGD momentum over:
    momentum correction, issue 17); torch's hooks leave it alone. ``hook_kwargs`` go to
    ``comms.register`` (e.g. ``warmup_steps``)."""
    if cfg.kind == "dense":
        return None
    if cfg.kind == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(process_group, default_hooks.fp16_compress_hook)
        return None
    if cfg.kind == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        st = powerSGD_hook.PowerSGDState(process_group=process_group,
                                         matrix_approximation_rank=cfg.rank,
                                         start_powerSGD_iter=max(2, start_iter),
                                         random_seed=0)
        ddp.register_comm_hook(st, powerSGD_hook.powerSGD_hook)
        return st
    if cfg.kind == "ours":
        import comms

        return comms.register(ddp, cfg.spec, process_group=process_group, algorithm=cfg.algorithm,
                              error_feedback=cfg.error_feedback, start_iter=start_iter,
                              optimizer=optimizer, **hook_kwargs)
    raise ValueError(f"unknown hook kind {cfg.kind!r}")


def dense_wire_bytes(numel: int, world: int, itemsize: int = 4) -> int:
    """Bytes each rank sends in a ring allreduce of ``numel`` elements."""
    return 2 * (world - 1) * numel * itemsize // world


def torch_powersgd_wire_bytes(params: Iterable, rank: int, world: int,
                              min_compression_rate: float = 2.0) -> int:
    """Bytes per rank per step of torch's ``powerSGD_hook`` (its own compress-or-not rule):
    matrices with ``(rows + cols) * rank * rate < rows * cols`` send P and Q, the rest go dense."""
    elems = 0
    for p in params:
        if p.dim() > 1:
            rows = p.shape[0]
            cols = p.numel() // rows
            if (rows + cols) * rank * min_compression_rate < rows * cols:
                elems += (rows + cols) * rank
                continue
        elems += p.numel()
    return dense_wire_bytes(elems, world)


def config_wire_bytes(cfg: HookConfig, state, params: list, world: int) -> int | None:
    """Bytes each rank sends per step with ``cfg`` (after warm-up)."""
    numel = sum(p.numel() for p in params)
    if cfg.kind == "dense":
        return dense_wire_bytes(numel, world)
    if cfg.kind == "torch-fp16":
        return dense_wire_bytes(numel, world, 2)
    if cfg.kind == "torch-powersgd":
        return torch_powersgd_wire_bytes(params, cfg.rank, world)
    # buckets in state.stats were compressed; the rest (e.g. the auto planner chose dense) were not
    stats = getattr(state, "stats", {}) or {}
    covered = sum(s.dense_bytes for s in stats.values())
    return sum(s.wire_bytes for s in stats.values()) + max(0, dense_wire_bytes(numel, world) - covered)


def config_algorithm(cfg: HookConfig, state, dense_bytes: int) -> str:
    """The algorithm column: for ``auto``, what the planner chose for the buckets."""
    if cfg.kind != "ours":
        return cfg.kind
    if cfg.algorithm != "auto":
        return cfg.algorithm or "-"
    stats = getattr(state, "stats", {}) or {}
    chosen = sorted({s.algorithm for s in stats.values()})
    if sum(s.dense_bytes for s in stats.values()) < dense_bytes:
        chosen.append("dense")
    return "auto:" + "+".join(dict.fromkeys(chosen))


# -- launching ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ENV_LAUNCHERS = (  # (rank var, world var, local rank var, name)
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "torchrun"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "openmpi"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "mpich"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "pmix"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "slurm"),
)


def env_rank_world() -> tuple[int, int, str] | None:
    """(rank, world, launcher) from torchrun / MPI / Slurm variables, or ``None``."""
    for rv, wv, _lv, name in _ENV_LAUNCHERS:
        if rv in os.environ and wv in os.environ:
            return int(os.environ[rv]), int(os.environ[wv]), name
    return None


def threads_for(ranks_on_host: int) -> int:
    """Intra-op threads per rank: the cores shared evenly (2 cores, 2 ranks -> 1 each)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, ranks_on_host))


def init_distributed(rank: int, world: int, launcher: str, master_port: int | None = None,
                     timeout_s: float = 600.0):
    """``init_process_group("gloo")`` for an env- or netsim-launched rank."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    addr = os.environ.get("MASTER_ADDR") or os.environ.get("NETSIM_MASTER") or "127.0.0.1"
    port = master_port or os.environ.get("MASTER_PORT")
    if port is None and launcher in ("openmpi", "mpich", "pmix"):
        try:  # every rank must agree on one port: rank 0 picks, MPI broadcasts
            from mpi4py import MPI

            port = MPI.COMM_WORLD.bcast(free_port() if rank == 0 else None, root=0)
        except ImportError:
            port = 29500
    port = int(port or 29500)
    os.environ.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    # netsim hosts share this machine's cores, like ranks on one node
    local_world = world if launcher == "netsim" else int(os.environ.get(
        "LOCAL_WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE",
                                           os.environ.get("MPI_LOCALNRANKS", world))))
    torch.set_num_threads(threads_for(local_world))
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))


def add_launch_args(p) -> None:
    """Flags shared by every DDP bench."""
    p.add_argument("-n", "--nprocs", type=int, default=2,
                   help="ranks to self-spawn (ignored under torchrun/mpirun)")
    p.add_argument("--netsim", metavar="RATE", default=None,
                   help="run each rank on its own netsim host with links shaped to RATE "
                        "(e.g. 1gbit, 500mbit); needs root")
    p.add_argument("--rank", type=int, default=None, help=argparse_hidden())
    p.add_argument("--world", type=int, default=None, help=argparse_hidden())
    p.add_argument("--master-port", type=int, default=None, help=argparse_hidden())
    p.add_argument("--no-lock", action="store_true",
                   help=f"do not serialize on {BENCH_LOCK} (the netsim lock is always taken)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before every rank is killed")


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


@contextlib.contextmanager
def file_lock(path: str, what: str = ""):
    """Hold an exclusive ``flock`` on ``path`` (the same lock ``flock(1)`` takes)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"# waiting for {path} {what}".rstrip(), file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def find_netsim() -> str | None:
    """``../shared/tools/netsim`` next to the repository, else ``bench/netsim``."""
    for p in (os.path.join(os.path.dirname(ROOT), "shared", "tools", "netsim"),
              os.path.join(ROOT, "bench", "netsim")):
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def _netsim_ok() -> str | None:
    if os.geteuid() != 0:
        return "netsim needs root (ip netns, tc)"
    if find_netsim() is None:
        return "netsim not found at ../shared/tools/netsim or bench/netsim"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "netsim needs iproute2 (ip, tc)"
    return None


def netsim_run(script: str, argv: Sequence[str], world: int, rate: str,
               timeout: float = 1800.0, stdout=None) -> int:
    """Run ``world`` ranks of ``script`` on netsim hosts shaped to ``rate``; one rank per host.

    Holds ``/tmp/netsim.lock`` from ``netsim up`` to ``netsim down``. Rank k runs as
    ``netsim exec k python script --rank k --world N --master-port P argv...`` with
    ``MASTER_ADDR=$NETSIM_MASTER``. Returns 0, or raises ``RuntimeError`` on a failed rank or
    timeout (every rank is killed; the hosts are torn down).
    """
    why = _netsim_ok()
    if why:
        raise RuntimeError(why)
    netsim = find_netsim()
    port = 29400 + (os.getpid() % 500)
    procs: list[subprocess.Popen] = []
    with file_lock(NETSIM_LOCK, "(netsim)"):
        subprocess.run([netsim, "up", str(world), rate], check=True, stdout=subprocess.DEVNULL)
        try:
            for k in range(world):
                cmd = [netsim, "exec", str(k), "bash", "-c", 'MASTER_ADDR=$NETSIM_MASTER exec "$@"', "_",
                       sys.executable, script, "--rank", str(k), "--world", str(world),
                       "--master-port", str(port), "--no-lock", *argv]
                procs.append(subprocess.Popen(cmd, stdout=stdout if k == 0 else subprocess.DEVNULL,
                                              start_new_session=True))
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.poll() for p in procs]
                bad = [(k, c) for k, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    raise RuntimeError(f"netsim rank(s) failed with exit codes {bad}")
                if all(c == 0 for c in codes):
                    return 0
                if time.monotonic() > deadline:
                    raise RuntimeError(f"netsim run timed out after {timeout:.0f}s")
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
            subprocess.run([netsim, "down"], check=False, stdout=subprocess.DEVNULL)


def launch(script: str, body: Callable[..., Any], args, argv: Sequence[str]) -> Any:
    """Run ``body(rank, world, args)`` under whatever launched this process.

    Returns rank 0's result in-process for env/netsim-child launches (``None`` on other
    ranks), the list of per-rank results when self-spawned, and ``None`` for a netsim parent
    (the rank processes print and write the results themselves).
    """
    import torch.distributed as dist

    if args.rank is not None:  # a netsim child
        init_distributed(args.rank, args.world, "netsim", args.master_port, args.timeout)
        try:
            return body(args.rank, args.world, args)
        finally:
            dist.destroy_process_group()
    env = env_rank_world()
    if env is not None:
        rank, world, launcher = env
        init_distributed(rank, world, launcher, None, args.timeout)
        try:
            return body(rank, world, args)
        finally:
            dist.destroy_process_group()
    lock = contextlib.nullcontext() if args.no_lock else file_lock(BENCH_LOCK, "(bench)")
    with lock:
        if args.netsim:
            passthrough = _strip_flags(argv, {"--netsim": 1, "-n": 1, "--nprocs": 1})
            return netsim_run(script, passthrough, args.nprocs, args.netsim, args.timeout)
        from comms.launch import spawn

        env = {"COMMPRESS_THREADS": str(threads_for(args.nprocs))}
        return spawn(body, args.nprocs, args, timeout=args.timeout, env=env)


def _strip_flags(argv: Sequence[str], flags: dict[str, int]) -> list[str]:
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
    import shlex

    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    return " ".join(["python", shlex.quote(script), *map(shlex.quote, argv)])


# -- output ---------------------------------------------------------------------------------
def progress(iterable: Iterable, total: int | None = None, desc: str = "", enable: bool = True):
    """tqdm when installed, else a one-line-per-item fallback on stderr."""
    if not enable:
        return iterable
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        return _fallback_progress(iterable, total, desc)


def _fallback_progress(iterable, total, desc):
    t0 = time.monotonic()
    for i, item in enumerate(iterable):
        print(f"# {desc} {i + 1}/{total or '?'} ({time.monotonic() - t0:.0f}s)", file=sys.stderr,
              flush=True)
        yield item


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def format_table(rows: list[dict], columns: Sequence[str], markdown: bool = False) -> str:
    """Right-aligned text table (or a markdown table) of ``rows`` in ``columns`` order."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    if markdown:
        out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if i else "---" for i in
                                                                 range(len(columns))) + "|"]
        out += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(out)
    width = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(columns, width)))]
    out += ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, width)))
            for row in cells]
    return "\n".join(out)


def write_csv(path: str, rows: list[dict], columns: Sequence[str]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c) for c in columns})


def machine_facts() -> str:
    """One line: CPU model, cores, torch version, date."""
    import platform

    import torch

    cpu = platform.processor() or "cpu"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    load = "?"
    with contextlib.suppress(OSError):
        load = os.getloadavg()[0]
        load = f"{load:.1f}"
    # the load average says how much other work shared the cores during the run
    return (f"{cpu}, {threads_for(1)} cores, torch {torch.__version__}, Python "
            f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"1-min load average at the end {load}")


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)

