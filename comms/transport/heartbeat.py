"""``HEARTBEAT``: which peers stopped answering, for the text of a failed collective."""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time

__all__ = ["Heartbeat", "HEARTBEAT"]


class Heartbeat:
    """Which peers stopped answering, for the error text of a failed or timed-out collective.

    A daemon thread writes ``commpress/hb/<rank>`` = ``"<wall time> <host> <pid>"`` into the
    default process group's store every ``period`` s once training started. :meth:`silent`
    (in a helper thread, each read bounded by ``read_timeout``) names the peers that are

    * **dead** or **stopped**: a peer on this host whose pid is gone (or a zombie) or stopped
      (``SIGSTOP``, state ``T`` in ``/proc``) — seen at once, even right after a kill;
    * **silent**: a peer whose last beat is older than ``3 * period``; when none is yet and
      ``settle`` > 0, it reads again after up to ``settle`` s and names the peers whose beat
      did not advance (a peer on another host killed a moment ago).

    Off the hot path: one tiny store write per second per rank, never a collective."""

    PREFIX = "commpress/hb/"

    def __init__(self, period: float = 1.0, read_timeout: float = 1.5):
        self.period, self.read_timeout = period, read_timeout
        self._thread = None
        self._stop = threading.Event()

    def start(self) -> None:
        if self._thread is not None:
            return
        import torch.distributed as dist

        try:
            from torch.distributed import distributed_c10d as c10d

            store, rank, world = c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
        except Exception:  # noqa: BLE001 - no default group / private API moved: no names
            self._thread = False
            return
        self._store, self._rank, self._world = store, rank, world
        self._me = f"{socket.gethostname()} {os.getpid()}"
        self._thread = threading.Thread(target=self._beat, name="commpress-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the beating thread and drop the store (at interpreter exit, see Watchdog.stop)."""
        self._stop.set()
        t = self._thread
        if t and t.is_alive() and t is not threading.current_thread():
            t.join(2.0)
        self._store = None

    def _beat(self) -> None:
        key = f"{self.PREFIX}{self._rank}"
        while not self._stop.is_set():
            try:
                self._store.set(key, f"{time.time()!r} {self._me}")
            except Exception:  # noqa: BLE001 - store gone (destroy_process_group, rank 0 dead)
                return
            self._stop.wait(self.period)

    def _read(self):
        """Every rank's last beat ``(time, host, pid)`` or ``None``; an ``Exception`` when the
        store does not answer within ``read_timeout``."""
        out: list = []
        store, world = self._store, self._world

        def read():
            try:  # get() would wait for a key that was never set: check() first
                keys = [f"{self.PREFIX}{r}" for r in range(world)]
                there = [k for k in keys if store.check([k])]
                got = dict(zip(there, store.multi_get(there))) if there else {}
                out.append([_parse_beat(got[k]) if k in got else None for k in keys])
            except Exception as exc:  # noqa: BLE001
                out.append(exc)

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(self.read_timeout)
        return out[0] if out else TimeoutError("no answer")

    def silent(self, settle: float = 0.0) -> str:
        """``"rank 2 is dead (pid 812 on this host exited)"``-style text, or ``""`` when
        no peer can be named (see the class)."""
        if not self._thread or self._store is None:
            return ""
        first = self._read()
        if isinstance(first, Exception):
            return ("the rendezvous store did not answer either: the rank hosting it (rank 0, "
                    "MASTER_ADDR) may be the stuck or dead one")
        named = self._local_states(first)
        if named:
            return "; ".join(named)
        now = time.time()
        old = [(r, now - b[0]) for r, b in enumerate(first) if r != self._rank and b is not None
               and now - b[0] > 3 * self.period]
        if old:
            return "rank(s) %s stopped answering %s s ago" % (
                [r for r, _ in old], "/".join(f"{a:.0f}" for _, a in old))
        if settle <= 0:
            return ""  # a kill is seen before its heartbeat ages: say nothing rather than guess
        deadline, again = time.monotonic() + settle, first
        while time.monotonic() < deadline:
            self._stop.wait(min(self.period / 2, max(0.0, deadline - time.monotonic())))
            again = self._read()
            if isinstance(again, Exception):
                return ("the rendezvous store stopped answering: the rank hosting it (rank 0, "
                        "MASTER_ADDR) may be the stuck or dead one")
            moved = [r for r, (a, b) in enumerate(zip(first, again))
                     if r != self._rank and a is not None and b is not None and b[0] != a[0]]
            if len(moved) == self._world - 1:
                return ""  # every peer is beating: none can be named
        stuck = [r for r, (a, b) in enumerate(zip(first, again)) if r != self._rank and
                 a is not None and b is not None and b[0] == a[0]]
        return f"rank(s) {stuck} stopped answering (no heartbeat for {settle:g} s)" if stuck else ""

    def _local_states(self, beats) -> list[str]:
        """Peers on this host whose process is gone or stopped, from ``/proc``."""
        host, out = socket.gethostname(), []
        for r, b in enumerate(beats):
            if r == self._rank or b is None or b[1] != host or b[2] is None:
                continue
            state = _proc_state(b[2])
            if state in (None, "Z", "X"):
                out.append(f"rank {r} is dead (pid {b[2]} on this host exited)")
            elif state in ("T", "t"):
                out.append(f"rank {r} is stopped (pid {b[2]} on this host, SIGSTOP or a debugger)")
        return out


def _parse_beat(raw: bytes):
    parts = raw.decode().split()
    pid = int(parts[2]) if len(parts) >= 3 and parts[2].isdigit() else None
    return float(parts[0]), (parts[1] if len(parts) >= 2 else None), pid


def _proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc`` (``None``: no such process); ``"?"`` where
    ``/proc`` cannot tell (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        return "?"


HEARTBEAT = Heartbeat()
atexit.register(HEARTBEAT.stop)
