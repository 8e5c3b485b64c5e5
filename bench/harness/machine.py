"""Facts about the machine a bench ran on, for the results files, and how to share its cores."""

from __future__ import annotations

import contextlib
import os
import platform
import time

__all__ = ["cpu_model", "usable_cores", "threads_for", "machine_facts"]


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


def machine_facts() -> str:
    """One line: CPU model, cores, torch version, date, load average."""
    import torch

    load = "?"
    with contextlib.suppress(OSError):
        load = f"{os.getloadavg()[0]:.1f}"
    # the load average says how much other work shared the cores during the run
    return (f"{cpu_model()}, {threads_for(1)} cores, torch {torch.__version__}, Python "
            f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"1-min load average at the end {load}")
