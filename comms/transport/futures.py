"""Small helpers over ``torch.futures.Future`` used by the hook and the communicators."""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from .errors import clean_message

__all__ = ["completed", "device_future", "guarded", "stream_mark", "wait_mark", "when_all"]

logger = logging.getLogger(__name__)


def completed(value: Any) -> torch.futures.Future:
    """A future that already holds ``value``."""
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def device_future(value: Any) -> torch.futures.Future:
    """An empty future for ``value``: CUDA-aware when ``value`` is a CUDA tensor.

    A plain ``torch.futures.Future`` completed from a done-callback carries no CUDA events:
    whoever waits on it (DDP) would read the tensor on its own stream before the kernels the
    hook ran on other streams are done; on an H200 that changed results from run to run and
    broke replica identity. With ``devices``, ``set_result`` records an event on the current
    stream and ``wait()`` makes the waiter's stream wait for it.
    """
    if isinstance(value, torch.Tensor) and value.is_cuda:
        return torch.futures.Future(devices=[value.device])
    return torch.futures.Future()


def stream_mark(t: torch.Tensor):
    """A CUDA event recorded now on the current stream of ``t``'s device (``None`` on CPU).

    The hook enqueues work on its own stream while a collective is in flight (the residual
    ``x - own``, this rank's decoded share), and the collective's ``then`` callback runs on
    another stream: it must :func:`wait_mark` before it writes the aggregate into ``x``, or
    the residual may read the aggregate instead of the gradient. GPU-side only: no host sync.
    """
    if not t.is_cuda:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


def wait_mark(mark, t: torch.Tensor) -> None:
    """Make the current stream of ``t``'s device wait for ``mark`` (no-op for ``None``)."""
    if mark is not None:
        torch.cuda.current_stream(t.device).wait_event(mark)


def guarded(fut: torch.futures.Future, where: str) -> torch.futures.Future:
    """Re-raise a failed collective as a ``RuntimeError`` that says which one failed."""

    def check(f):
        try:
            return f.value()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            # torch wraps what a callback raises; the hook's last hop unwraps it
            # (comms.transport.errors.failure), so only the collective's own reason is kept here
            raise RuntimeError(f"{where} failed: {clean_message(exc)}") from exc

    return fut.then(check)


def when_all(futs, value) -> torch.futures.Future:
    """A future of ``value`` once every one of ``futs`` is done (the first error wins).

    Not ``torch.futures.collect_all``: it completes at the first error, before the other
    futures are done."""
    out = device_future(value)
    left = [len(futs)]
    lock = threading.Lock()  # callbacks may run on several collective threads at once

    def one(_f):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            try:
                for f in futs:
                    f.wait()  # on CUDA: this thread's stream waits for each future's work
                out.set_result(value)
            except BaseException as exc:  # noqa: BLE001 - forwarded to DDP
                out.set_exception(exc)

    for f in futs:
        f.add_done_callback(one)
    return out
