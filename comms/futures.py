"""Small helpers over ``torch.futures.Future``: completed futures and flat chaining."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

__all__ = ["completed", "chain", "failed"]

logger = logging.getLogger(__name__)


def completed(value: Any) -> torch.futures.Future:
    """A future that already holds ``value``."""
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def failed(exc: BaseException) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_exception(exc)
    return fut


def chain(fut: torch.futures.Future, fn: Callable[[Any], torch.futures.Future]) -> torch.futures.Future:
    """Run ``fn(fut.value())`` (which starts more async work and returns a Future) when
    ``fut`` completes, and return one future for the final value — ``Future.then`` would
    give a future *of a future*. Exceptions at any stage propagate to the result."""
    out = torch.futures.Future()

    def _inner(g):
        try:
            out.set_result(g.value())
        except BaseException as exc:  # noqa: BLE001 - forwarded to the waiter
            out.set_exception(exc)

    def _outer(f):
        try:
            nxt = fn(f.value())
        except BaseException as exc:  # noqa: BLE001
            out.set_exception(exc)
            return
        nxt.add_done_callback(_inner)

    fut.add_done_callback(_outer)
    return out
