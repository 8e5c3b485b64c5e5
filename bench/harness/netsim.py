"""Run rank processes on netsim hosts: network namespaces whose links are shaped with tc.

``netsim up N RATE`` creates hosts ``0..N-1`` joined by links shaped to ``RATE`` each way;
``netsim exec K cmd`` runs ``cmd`` in host ``K`` with ``$NETSIM_MASTER`` set to host 0's
address; ``netsim down`` removes them. :func:`run_on_hosts` does all three around a set of
rank processes and guarantees the teardown: a failed rank, a timeout or an exception kills
every rank's process group and runs ``netsim down``. It holds ``NETSIM_LOCK`` from ``up`` to
``down`` (there is one set of hosts per machine).

Needs root, iproute2 and the netsim script (``../shared/tools/netsim`` next to the
repository, else ``bench/netsim``); :func:`netsim_unavailable` says why not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import time
from typing import Sequence

from . import ROOT
from .locks import NETSIM_LOCK, file_lock

__all__ = ["NetsimRank", "find_netsim", "netsim_unavailable", "rendezvous_port", "run_on_hosts"]


@dataclasses.dataclass(frozen=True)
class NetsimRank:
    """One rank process: the host it runs in, its command, extra environment, where its stdout goes
    (``None``: inherited; the default sends it nowhere, as only rank 0 prints tables)."""

    host: int
    argv: Sequence[str]
    env: dict | None = None
    stdout: object = subprocess.DEVNULL


def find_netsim() -> str | None:
    """``../shared/tools/netsim`` next to the repository if present, else ``bench/netsim``."""
    for p in (os.path.join(os.path.dirname(ROOT), "shared", "tools", "netsim"),
              os.path.join(ROOT, "bench", "netsim")):
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def netsim_unavailable() -> str | None:
    """Why netsim cannot run here, or ``None``."""
    if os.geteuid() != 0:
        return "netsim needs root (ip netns, tc)"
    if find_netsim() is None:
        return "netsim not found at ../shared/tools/netsim or bench/netsim"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "netsim needs iproute2 (ip, tc)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "ip netns is not usable here"
    return None


def rendezvous_port() -> int:
    """A port for the ranks' TCP rendezvous on host 0 (the parent picks it once for all ranks;
    the hosts are fresh namespaces, so :func:`comms.cluster.launch.free_port` here would not apply)."""
    return 29400 + os.getpid() % 500


def run_on_hosts(hosts: int, rate: str, ranks: Sequence[NetsimRank], timeout: float = 1800.0,
                 lock: bool = True) -> None:
    """Bring up ``hosts`` netsim hosts shaped to ``rate``, run ``ranks`` in them, tear down.

    Each rank runs as ``netsim exec HOST bash -c 'MASTER_ADDR=$NETSIM_MASTER exec "$@"' _ ARGV``
    in a session of its own. Returns when every rank exited 0.

    Args:
        lock: take ``NETSIM_LOCK`` (callers that already hold it pass False).

    Raises:
        RuntimeError: netsim is unavailable, a rank exited non-zero, or ``timeout`` passed
            (every rank is killed and the hosts are torn down first).
    """
    why = netsim_unavailable()
    if why:
        raise RuntimeError(why)
    netsim = find_netsim()
    procs: list[subprocess.Popen] = []
    with file_lock(NETSIM_LOCK, "(netsim)") if lock else contextlib.nullcontext():
        subprocess.run([netsim, "up", str(hosts), rate], check=True, stdout=subprocess.DEVNULL)
        try:
            for r in ranks:
                cmd = [netsim, "exec", str(r.host), "bash", "-c", 'MASTER_ADDR=$NETSIM_MASTER exec "$@"',
                       "_", *r.argv]
                procs.append(subprocess.Popen(cmd, env=r.env, stdout=r.stdout, start_new_session=True))
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.poll() for p in procs]
                bad = [(k, c) for k, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    raise RuntimeError(f"netsim rank(s) failed (rank, exit code): {bad}")
                if all(c == 0 for c in codes):
                    return
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
