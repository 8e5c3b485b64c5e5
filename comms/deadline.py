"""Bounded waits: no rank of commpress waits longer than the timeout for a stuck or dead peer.

Why this exists. gloo bounds each collective by the process-group timeout once the
collective *runs*, but a survivor can still wait forever:

* DDP's reducer waits, without a timeout, on the futures the hook returned; a future whose
  source is queued behind a stuck collective on gloo's worker threads, or whose peer never
  issued its half, completes only when gloo gets to it — after ``T`` per queued op, or never;
* ``torch.futures.Future.wait()`` has no timeout, and the intermediate rounds of multi-round
  algorithms, the configuration check, the planner's probe and tuning allgathers block on it;
* a Python exception raised in a ``Future.then`` callback reaches ``backward()`` wrapped as
  ``Unable to cast Got the following error when running the callback: ...``.

So every blocking wait of commpress goes through :func:`wait` (an ``Event`` with a timeout),
and every step's DDP futures are watched by one process-wide :class:`Watchdog` thread that
completes those still pending ``timeout`` seconds after the step's last bucket was issued
with a :class:`CollectiveTimeout`. Neither adds a collective or a host sync: :func:`wait`
replaces a wait that was already there, and the watchdog costs one list append per step.

The timeout is the process group's (``init_process_group(timeout=...)``, read from the
group's backend options) unless the user sets ``register(..., timeout=seconds)``.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import re
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed

__all__ = ["CollectiveTimeout", "group_timeout", "check_timeout", "wait", "wait_work", "BoundedWork",
           "WORK_WAITER", "fail", "clean_message",
           "advice", "failure", "timeout_error", "Watchdog", "WATCHDOG",
           "Heartbeat", "HEARTBEAT"]

logger = logging.getLogger(__name__)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the timeout: a peer is stuck, dead or far behind."""


ADVICE = ("the process group cannot be used any more: stop training on every rank and restart "
          "from the last checkpoint (torchrun --max-restarts restarts the job); if the peer was "
          "only slow, raise init_process_group(timeout=...) or register(..., timeout=...)")


def advice() -> str:
    """What to do after a failed or timed-out collective (the tail of every such error)."""
    return ADVICE


def check_timeout(value) -> float | None:
    """Validate a user ``timeout`` (seconds > 0, a ``timedelta``, or ``None``); seconds or None."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"timeout must be a positive number of seconds, a timedelta or None, got {value!r}")
    return float(value)


def group_timeout(group=None) -> float | None:
    """The timeout of a torch.distributed process group in seconds (``None``: unknown)."""
    import torch.distributed as dist

    try:
        pg = group if group is not None else dist.group.WORLD
        for dev in ("cpu", "cuda"):
            try:
                be = pg._get_backend(torch.device(dev))
            except Exception:  # noqa: BLE001 - no backend for this device type
                continue
            t = getattr(getattr(be, "options", None), "_timeout", None)
            if t is not None:
                return t.total_seconds()
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_timeout(dist.get_backend(group)).total_seconds()
    except Exception:  # noqa: BLE001 - private API moved: no bound rather than a crash
        logger.debug("process-group timeout unknown", exc_info=True)
        return None


# torch wraps an exception raised in a Future callback as "Got the following error when running
# the callback: <type>: <msg>\n\nAt:\n  <frames>", and DDP's result cast prefixes "Unable to cast"
_WRAPPERS = re.compile(r"^(?:Unable to cast\s*)?(?:Got the following error when running the callback:\s*)?"
                       r"(?:[A-Za-z_.]*(?:Error|Exception|Timeout):\s*)?")


def clean_message(exc: BaseException) -> str:
    """The message of ``exc`` without torch's callback wrapping and traceback tail."""
    msg = str(exc)
    prev = None
    while prev != msg:
        prev = msg
        msg = _WRAPPERS.sub("", msg, count=1).strip()
    msg = msg.split("\n\nAt:\n")[0]
    msg = re.sub(r"\s*to Tensor$", "", msg)
    # gloo's source location and its boilerplate advice (commpress gives its own)
    msg = re.sub(r"\[[^\]\s]*\.(?:cc|cpp|h):\d+\]\s*", "", msg)
    msg = re.sub(r"\s*This is typically caused by .*?(?:GLHF!\s*\S*|$)", "", msg, flags=re.S)
    return msg.strip()


def failure(what: str, exc: BaseException) -> BaseException:
    """One clean error for a failed collective, for DDP/FSDP to raise from ``backward()``.

    A commpress error (message starting ``commpress:``, possibly buried in torch's callback
    wrapping) is passed on with its own wording (the first failure names the collective);
    anything else becomes ``"<what> failed: <reason> (<the dead or silent peers>)"``. Both end
    with what to do."""
    if isinstance(exc, (ValueError, TypeError)) and str(exc).startswith("commpress:"):
        return exc  # a configuration error: its own advice
    msg = clean_message(exc)
    if not msg.startswith("commpress:"):
        # a lost connection names its peer by address only: tell which rank is dead or silent
        lost = any(k in msg for k in _PEER_LOSS)
        msg = f"{what} failed: {msg}{_peers_hint(PEER_SETTLE_S if lost else 0.0)}"
    if ADVICE not in msg:
        msg = f"{msg}; {ADVICE}"
    timed_out = isinstance(exc, CollectiveTimeout) or "did not complete within" in msg
    return CollectiveTimeout(msg) if timed_out else RuntimeError(msg)


#: how a transport says its peer went away (gloo, NCCL, MPI)
_PEER_LOSS = ("Connection reset", "Connection closed", "Broken pipe", "Connection refused",
              "remote process exited")
#: seconds a failure waits for the heartbeats to tell which peer went silent (only when no
#: peer on this host is seen dead or stopped at once)
PEER_SETTLE_S = 2.5


def timeout_error(what: str, seconds: float) -> CollectiveTimeout:
    return CollectiveTimeout(
        f"{what} did not complete within {seconds:g} s: a peer rank is stuck (stopped, hung, "
        f"deadlocked), dead, or far behind{_peers_hint(1.5)}; {ADVICE}")


def _peers_hint(settle: float = 0.0) -> str:
    peers = HEARTBEAT.silent(settle)
    return f" ({peers})" if peers else ""


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


def wait(fut: torch.futures.Future, timeout: float | None, what: str):
    """``fut.wait()`` bounded by ``timeout`` seconds (``None``: unbounded).

    Raises:
        CollectiveTimeout: not complete in time (message starts with ``what``).
        RuntimeError: the collective failed (``"<what> failed: <reason>; <advice>"``).
    """
    if timeout is not None and not fut.done():
        done = threading.Event()
        fut.add_done_callback(lambda _f: done.set())
        if not done.wait(timeout):
            raise timeout_error(what, timeout)
    try:
        return fut.wait()
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise failure(what, exc) from None


def wait_work(work, timeout: float | None, what: str) -> None:
    """``work.wait()`` of a torch.distributed ``Work`` bounded by ``timeout`` seconds (``None``:
    unbounded), with :func:`wait`'s errors. A Work without a future (gloo's reduce-scatter in
    torch 2.13) is waited on by :data:`WORK_WAITER`'s thread: gloo's own ``wait(timeout)``
    does not return before the peer does."""
    try:
        fut = work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        fut = None
    if fut is not None:
        wait(fut, timeout, what)
        return
    if timeout is None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise failure(what, exc) from None
        return
    wait(WORK_WAITER.submit(work), timeout, what)


class _WorkWaiter:
    """One daemon thread that calls ``wait()`` on Works without a future and completes a
    future for each, in submission order (a stuck one holds the rest back: they time out too,
    as they should — the group is broken)."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, work) -> torch.futures.Future:
        fut = torch.futures.Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="commpress-work-waiter", daemon=True)
                self._thread.start()
        self._q.put((work, fut))
        return fut

    def _run(self) -> None:
        while True:
            work, fut = self._q.get()
            try:
                work.wait()
                fut.set_result(True)
            except Exception as exc:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(exc)


WORK_WAITER = _WorkWaiter()

class BoundedWork(torch.distributed.Work):
    """A ``torch.distributed.Work`` FSDP waits on (a prefetched all-gather, an asynchronous
    reduce-scatter) over a future or another Work: ``wait()`` is :func:`wait` /
    :func:`wait_work` — bounded by ``timeout``, raising commpress's error (``what``) when the
    transfer failed. torch's own ``_create_work_from_future`` returns ``True`` from ``wait()``
    even when its future failed: a dead peer's all-gather would leave FSDP computing on
    whatever the output buffer held."""

    def __init__(self, source, timeout: float | None, what: str):
        super().__init__()
        self._source, self._timeout, self._what = source, timeout, what

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - the commpress bound applies
        if isinstance(self._source, torch._C.Future):
            wait(self._source, self._timeout, self._what)
        else:
            wait_work(self._source, self._timeout, self._what)
        return True

    def is_completed(self) -> bool:
        src = self._source
        return src.done() if isinstance(src, torch._C.Future) else src.is_completed()

    def get_future(self) -> torch.futures.Future:
        src = self._source
        return src if isinstance(src, torch._C.Future) else src.get_future()


def fail(fut: torch.futures.Future, exc: BaseException) -> bool:
    """Complete ``fut`` with ``exc`` unless it is already complete (racing completions: the
    watchdog and the collective's own callback); returns whether this call completed it."""
    if fut.done():
        return False
    try:
        fut.set_exception(exc)
        return True
    except RuntimeError:  # completed by the other thread in between
        return False


class Watchdog:
    """One daemon thread per process that fires overdue deadlines.

    :meth:`watch` registers ``(deadline, done, fire)``: unless ``done()`` is true by the
    monotonic ``deadline``, the thread calls ``fire()`` once. The thread wakes every
    ``poll`` seconds (and drops finished entries); it never touches a tensor or a collective.
    """

    def __init__(self, poll: float = 0.25):
        self.poll = poll
        self._lock = threading.Lock()
        self._items: list = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def watch(self, deadline: float, done: Callable[[], bool], fire: Callable[[], None]) -> None:
        with self._lock:
            if self._stop.is_set():
                return  # the interpreter is exiting
            self._items.append((deadline, done, fire))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="commpress-watchdog", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """End the thread and forget every deadline (at interpreter exit: a daemon thread
        still calling into torch while C++ objects are torn down aborts the process)."""
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(2.0)
        with self._lock:
            self._items = []

    def pending(self) -> int:
        with self._lock:
            return len(self._items)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            now = time.monotonic()
            with self._lock:
                items, self._items = self._items, []
                if not items:  # idle: end; watch() starts a new thread when needed
                    self._thread = None
                    return
            keep, due = [], []
            for it in items:
                try:
                    finished = it[1]()
                except Exception:  # noqa: BLE001
                    finished = True
                if finished:
                    continue
                (due if now >= it[0] else keep).append(it)
            with self._lock:
                self._items[:0] = keep
            for _, _, fire in due:
                try:
                    fire()
                except Exception:  # noqa: BLE001 - never kill the watchdog
                    logger.exception("commpress watchdog: firing a deadline failed")


WATCHDOG = Watchdog()
atexit.register(WATCHDOG.stop)
