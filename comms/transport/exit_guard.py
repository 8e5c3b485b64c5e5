"""At interpreter exit: let gloo's worker threads finish with Python before Python tears down.

A gloo worker thread that completes a collective runs the Python callbacks chained on its
future (commpress's, torch's own comm hooks) and then drops their Python objects. The rank's
main thread wakes as soon as the future it waits on completes and may reach the end of the
script while that worker still needs the GIL. Once interpreter finalization has begun, CPython
ends such a thread with ``pthread_exit``, whose forced unwind through torch's ``noexcept``
frames calls ``std::terminate``: the process dies with "terminate called without an active
exception" (SIGABRT) after a run that succeeded — seen at exit of the HSDP and DDP snippets,
a backtrace of the aborting thread showed ``ProcessGroupGloo::runLoop`` in
``PyEval_AcquireThread``.

:func:`_at_exit` runs before finalization (``atexit``): it stops commpress's own threads, then
— in a process where commpress moved data through torch.distributed — releases the GIL for
:data:`GRACE_S`, so a worker finishing such a callback takes it while the interpreter is whole.
"""

from __future__ import annotations

import atexit
import time

from .deadlines import WATCHDOG
from .heartbeat import HEARTBEAT

__all__ = ["GRACE_S", "mark_used"]

#: seconds the exit handler leaves to gloo's worker threads (a callback's tail takes microseconds;
#: this covers a loaded machine's scheduling delays)
GRACE_S = 0.25

_used = False


def mark_used() -> None:
    """Record that this process issued collectives through torch.distributed (a communicator)."""
    global _used
    _used = True


def _at_exit() -> None:
    HEARTBEAT.stop()
    WATCHDOG.stop()
    if _used:
        time.sleep(GRACE_S)  # releases the GIL: a worker thread waiting for it runs now


atexit.register(_at_exit)
