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
and every step's DDP futures are watched by one process-wide :class:`~comms.transport.deadlines.DeadlineWatch` thread that
completes those still pending ``timeout`` seconds after the step's last bucket was issued
with a :class:`CollectiveTimeout`. Neither adds a collective or a host sync: :func:`wait`
replaces a wait that was already there, and the watchdog costs one list append per step.

The timeout is the process group's (``init_process_group(timeout=...)``, read from the
group's backend options) unless the user sets ``register(..., timeout=seconds)``.
"""

from __future__ import annotations

import logging
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed

from .errors import failure, timeout_error

__all__ = ["check_timeout", "group_timeout", "wait", "wait_work", "BoundedWork", "WORK_WAITER", "fail"]

logger = logging.getLogger(__name__)


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


