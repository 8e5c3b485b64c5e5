"""Facts about the machine a bench ran on, for the results files, and how to share its cores."""

from __future__ import annotations

import contextlib
import os
import platform
import time

__all__ = ["commit", "cpu_model", "usable_cores", "threads_for", "machine_facts"]


def cpu_model() -> str:
    """The ``model name`` of /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    cpu = platform.processor() or "cpu"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return cpu


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_for(ranks_on_host: int) -> int:
    """Intra-op threads per rank: the cores shared evenly (2 cores, 2 ranks -> 1 each)."""
    return max(1, usable_cores() // max(1, ranks_on_host))


def commit() -> str:
    """The checkout's short commit, ``+changes`` when tracked files differ from it."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, cwd=root).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "comms",
                                "compressors", "csrc", "bench/*.py", "bench/harness"],
                               capture_output=True, text=True, timeout=10, cwd=root).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+changes" if dirty else "")


def machine_facts() -> str:
    """One line: CPU model, cores, torch version, commit, date, load average."""
    import torch

    load = "?"
    with contextlib.suppress(OSError):
        load = f"{os.getloadavg()[0]:.1f}"
    # the load average says how much other work shared the cores during the run
    return (f"{cpu_model()}, {threads_for(1)} cores (subnormals flushed), torch {torch.__version__}, Python "
            f"{platform.python_version()}, commit {commit()}, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"1-min load average at the end {load}")
