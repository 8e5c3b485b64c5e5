"""Non-finite step flags: one tiny allreduce per step decides which buckets are poisoned.

Each compressed bucket computes a non-finite flag as a tensor (no host sync). Its future is
held back (:meth:`StepFlags.enqueue`) until the step's last bucket, when the flags of all
buckets ride one allreduce (:meth:`StepFlags.flush`). A bucket flagged on any rank comes back
all-NaN on every rank (so ``GradScaler`` skips the step, as with plain allreduce) and the
caller's ``on_nonfinite(bucket, step)`` resets its residual and store. The flag vector ends
with a 1 per rank: gloo can hand back garbage instead of an error once a peer has died, so a
rank count other than the world size discards the step with an error. The flags are read on
the host once per step, in a callback after the flag allreduce finished.

Bounded: at :meth:`StepFlags.flush` the step's futures are handed to the
process-wide watchdog (:mod:`comms.transport.deadlines`); those DDP still waits on ``comm.timeout``
seconds later are completed with a :class:`~comms.transport.errors.CollectiveTimeout` naming the
first collective that had not completed, so a stuck peer makes ``backward()`` raise instead of
waiting forever. Every error DDP gets is unwrapped from torch's callback wording first.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

import time

from ..transport.deadlines import WATCHDOG
from ..transport.errors import CollectiveTimeout, advice, failure, timeout_error, where
from ..transport.heartbeat import HEARTBEAT
from ..transport.waits import fail, wait
from ..transport.futures import device_future, guarded

__all__ = ["StepFlags", "PendingBucket"]

logger = logging.getLogger(__name__)


class PendingBucket:
    """A (sub-)bucket of this step waiting for the step's flags.

    ``flag`` is ``None`` for dense buckets (never poisoned by us); ``scatter`` writes a
    sub-bucket's result back into its DDP bucket."""

    __slots__ = ("bucket", "step", "flag", "x", "fut", "result", "scatter", "what")

    def __init__(self, bucket, step, flag, x, fut, scatter, what=None):
        self.bucket, self.step, self.flag, self.x, self.fut = bucket, step, flag, x, fut
        self.scatter = scatter
        self.what = what or f"commpress: collective of bucket {bucket} at step {step}"
        self.result = device_future(x)


class StepFlags:
    """This step's pending buckets and their batched non-finite check (see the module docstring)."""

    __slots__ = ("pending",)

    def __init__(self):
        self.pending: list[PendingBucket] = []

    def enqueue(self, bucket: int, step: int, flag, x: torch.Tensor, fut: torch.futures.Future,
                scatter=None, what: str | None = None) -> torch.futures.Future:
        """Hold ``fut`` (whose value is ``x``) until :meth:`flush`; returns the future DDP gets.
        ``what``: the collective's name in errors (:func:`comms.transport.errors.where`)."""
        p = PendingBucket(bucket, step, flag, x, fut, scatter, what)
        self.pending.append(p)
        return p.result

    def drop_stale(self, step: int) -> None:
        """A step that raised half-way never flushed: fail its buckets instead of leaving them."""
        stale = [p for p in self.pending if p.step != step]
        if stale:
            self.pending = [p for p in self.pending if p.step == step]
            for p in stale:
                fail(p.result, RuntimeError(f"commpress: step {p.step} was abandoned"))

    def flush(self, comm, step: int, on_nonfinite: Callable[[int, int], None]) -> None:
        """At the step's last bucket: one allreduce of every pending bucket's flag."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        device = pending[-1].x.device
        no = torch.zeros((), dtype=torch.bool, device=device)
        flags = torch.cat([torch.stack([no if p.flag is None else p.flag for p in pending]).to(torch.float32),
                           torch.ones(1, device=device)])
        if device.type != "cpu" and comm.backend in ("gloo", "mpi"):
            flags = flags.cpu()
        what = where(comm, "non-finite-flag allreduce", pending[-1].bucket, flags.numel(), flags.dtype, step)
        world = comm.world_size

        def host(f):
            vals = f.value().tolist()  # one host read per step, after the collective finished
            if vals[-1] != world:
                silent = HEARTBEAT.silent()
                raise RuntimeError(f"{what} returned a rank count of {vals[-1]:g} instead of {world}: "
                                   f"a peer died or disconnected{f' ({silent})' if silent else ''}; "
                                   f"this step's results are discarded; {advice()}")
            return vals

        try:
            ffut = guarded(comm.all_reduce(flags), what).then(host)
        except Exception as exc:  # noqa: BLE001
            ffut = torch.futures.Future()
            ffut.set_exception(RuntimeError(f"{what} failed: {exc}"))
        timeout = getattr(comm, "timeout", None)
        if timeout is not None:
            if comm.backend in ("gloo", "nccl"):
                HEARTBEAT.start()  # once: names the silent peers in timeout errors
            # DDP waits on these futures without a timeout: the watchdog completes the ones
            # still pending `timeout` s from now (one list append per step, no sync)
            WATCHDOG.watch(time.monotonic() + timeout, lambda: all(p.result.done() for p in pending),
                           lambda: _expire(pending, ffut, what, timeout))
        if device.type == "cpu":
            # DDP raises a failed hook future as "Unable to cast <exception> to Tensor" (a Python
            # Future's exception is its value to C++): check the step's futures in an autograd
            # final callback that runs before DDP's own and raise our clean error from there.
            # CPU only: DDP's finalize waits for the same futures right after, so this waits no
            # longer; on CUDA it would be a host sync (the watchdog still bounds DDP's wait)
            try:
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: _final_check(pending, ffut, what, timeout))
            except RuntimeError:  # not inside backward (the hook called directly)
                pass
        for i, p in enumerate(pending):
            # not collect_all: it completes at the first error, before the other future is done
            p.fut.add_done_callback(
                lambda _f, p=p, i=i: ffut.add_done_callback(lambda _g: _settle(p, i, ffut, on_nonfinite)))


def _final_check(pending: list[PendingBucket], flags_fut, flags_what: str, timeout) -> None:
    """Autograd final callback: wait (bounded) for the step's futures; raise the first
    failure with commpress's own message (see :meth:`StepFlags.flush`)."""
    end = None if timeout is None else time.monotonic() + timeout
    for p in pending:
        left = None if end is None else max(0.0, end - time.monotonic())
        try:
            wait(p.result, left, p.what)
        except CollectiveTimeout:
            _expire(pending, flags_fut, flags_what, timeout)
            wait(p.result, 0.0, p.what)  # raises the (named) timeout error DDP would see
        except Exception:  # noqa: BLE001 - already clean: failure() passes ours through
            raise


def _expire(pending: list[PendingBucket], flags_fut, flags_what: str, timeout: float) -> None:
    """The watchdog's deadline: fail every bucket DDP still waits on, naming the first
    collective of the step that had not completed (its bucket, step and rank)."""
    stuck = next((p.what for p in pending if not p.fut.done()), None)
    if stuck is None:
        stuck = flags_what if not flags_fut.done() else pending[0].what
    exc = timeout_error(stuck, timeout)
    for p in pending:
        fail(p.result, exc)


def _settle(p: PendingBucket, i: int, flags_fut, on_nonfinite) -> None:
    try:
        try:
            # wait(), not value(): on CUDA it also makes this thread's stream wait for the work
            # the chain ran on its own streams (the fill_/scatter below and DDP's read follow it)
            x = p.fut.wait()
        except Exception as exc:  # noqa: BLE001
            if "did not complete within" not in str(exc):
                # once a peer is gone gloo can hand back garbage instead of an error, and the
                # algorithm's decode then fails on it ("index out of range in self"): the
                # step's flag allreduce (which counts the ranks) says what really happened
                flags_fut.value()  # raises that failure when it failed too
            raise
        flags = flags_fut.value()
        if p.flag is not None and flags[i] > 0:
            # as with plain allreduce, the non-finite value reaches every rank; the residual
            # and store must not keep it
            x.fill_(float("nan"))
            on_nonfinite(p.bucket, p.step)
        if p.result.done():
            return  # the watchdog failed it already: do not touch the buffer any more
        if p.scatter is not None:
            p.scatter(x)
        p.result.set_result(x)
    except BaseException as exc:  # noqa: BLE001 - forwarded to DDP, unwrapped and with advice
        fail(p.result, failure(p.what, exc))
