"""The machine-wide locks the benches take, so that their timings never overlap.

``BENCH_LOCK`` is held by a bench for its whole run (two benches sharing the cores would time
each other); ``NETSIM_LOCK`` from ``netsim up`` to ``netsim down`` (there is one set of netsim
hosts per machine). Both are plain ``flock`` locks: ``flock /tmp/bench.lock cmd`` from a
shell takes the same one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys

__all__ = ["BENCH_LOCK", "NETSIM_LOCK", "file_lock"]

BENCH_LOCK = "/tmp/bench.lock"
NETSIM_LOCK = "/tmp/netsim.lock"


@contextlib.contextmanager
def file_lock(path: str, what: str = ""):
    """Hold an exclusive ``flock`` on ``path``; says on stderr when it has to wait."""
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
