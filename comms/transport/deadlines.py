"""``WATCHDOG``: one daemon thread per process that fires overdue deadlines (the DDP step's
futures still pending ``timeout`` seconds after its last bucket was issued)."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Callable

__all__ = ["DeadlineWatch", "WATCHDOG"]

logger = logging.getLogger(__name__)


class DeadlineWatch:
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


WATCHDOG = DeadlineWatch()
atexit.register(WATCHDOG.stop)
