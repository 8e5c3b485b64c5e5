"""Agreed step times: the autotuner's only input from the other ranks, and what may be one.

Every rank decides on the same numbers: the element-wise MAX over ranks of each measured step
(:func:`agree_step_seconds`, one small allgather). A collective that a dead peer's pair ended
can come back with garbage instead of an error on gloo; a value no step of any training can
take is refused here (:func:`check_step_seconds`), before the rules decide on it.
"""

from __future__ import annotations

import math

import torch

from ..transport.communicator import allreduce_max
from ..transport.errors import advice

__all__ = ["MAX_STEP_SECONDS", "MIN_STEP_SECONDS", "check_step_seconds", "agree_step_seconds"]

# no step of any training lasts this long: an agreed value beyond it is not a timing
MAX_STEP_SECONDS = 1e6
# nor this short (a step runs a backward and a collective: microseconds at the least); gloo's
# garbage after a peer died is often zeros, and a zero timing reached the rules' log-ratios
# as "math domain error" (a rank killed during the trials)
MIN_STEP_SECONDS = 1e-9


def check_step_seconds(values: list[float], what: str) -> list[float]:
    """``values`` (agreed step seconds, NaN = no sample) if each is NaN or in
    ``[MIN_STEP_SECONDS, MAX_STEP_SECONDS)``; else raise.

    Once a peer has died, gloo can hand a collective back with garbage instead of an error;
    decided on, garbage timings fail deep in the rules (``statistics`` overflows on 1e300)
    with a message that names nothing.

    Raises:
        RuntimeError: ``"<what> returned ... : a peer died or disconnected ...; <advice>"``,
            the advice (restart from the last checkpoint) every failed collective ends with.
    """
    bad = [v for v in values if not math.isnan(v) and not MIN_STEP_SECONDS <= v < MAX_STEP_SECONDS]
    if bad:
        raise RuntimeError(f"{what} returned {bad[0]!r} where step seconds belong: a peer died or "
                           "disconnected (gloo can hand back garbage instead of an error); this "
                           f"step's results are discarded; {advice()}")
    return values


def agree_step_seconds(comm, values: list[float], what: str) -> list[float]:
    """The element-wise MAX over ranks of ``values`` (this rank's step seconds, NaN = no
    sample), checked (:func:`check_step_seconds`). Collective: every rank calls it alike;
    ``what`` names the collective in errors."""
    agreed = allreduce_max(comm, torch.tensor(values, dtype=torch.float64), what).tolist()
    return check_step_seconds(agreed, what)
