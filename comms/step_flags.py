"""Non-finite step flags: one tiny allreduce per step decides which buckets are poisoned.

Each compressed bucket computes a non-finite flag as a tensor (no host sync). Its future is
held back (:meth:`StepFlags.enqueue`) until the step's last bucket, when the flags of all
buckets ride one allreduce (:meth:`StepFlags.flush`). A bucket flagged on any rank comes back
all-NaN on every rank (so ``GradScaler`` skips the step, as with plain allreduce) and the
caller's ``on_nonfinite(bucket, step)`` resets its residual and store. The flag vector ends
with a 1 per rank: gloo can hand back garbage instead of an error once a peer has died, so a
rank count other than the world size discards the step with an error. The flags are read on
the host once per step, in a callback after the flag allreduce finished.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .errors import where
from .futures import guarded

__all__ = ["StepFlags", "PendingBucket"]

logger = logging.getLogger(__name__)


class PendingBucket:
    """A (sub-)bucket of this step waiting for the step's flags.

    ``flag`` is ``None`` for dense buckets (never poisoned by us); ``scatter`` writes a
    sub-bucket's result back into its DDP bucket."""

    __slots__ = ("bucket", "step", "flag", "x", "fut", "result", "scatter")

    def __init__(self, bucket, step, flag, x, fut, scatter):
        self.bucket, self.step, self.flag, self.x, self.fut = bucket, step, flag, x, fut
        self.scatter = scatter
        self.result = torch.futures.Future()


class StepFlags:
    """This step's pending buckets and their batched non-finite check (see the module docstring)."""

    __slots__ = ("pending",)

    def __init__(self):
        self.pending: list[PendingBucket] = []

    def enqueue(self, bucket: int, step: int, flag, x: torch.Tensor, fut: torch.futures.Future,
                scatter=None) -> torch.futures.Future:
        """Hold ``fut`` (whose value is ``x``) until :meth:`flush`; returns the future DDP gets."""
        p = PendingBucket(bucket, step, flag, x, fut, scatter)
        self.pending.append(p)
        return p.result

    def drop_stale(self, step: int) -> None:
        """A step that raised half-way never flushed: fail its buckets instead of leaving them."""
        stale = [p for p in self.pending if p.step != step]
        if stale:
            self.pending = [p for p in self.pending if p.step == step]
            for p in stale:
                p.result.set_exception(RuntimeError(f"commpress: step {p.step} was abandoned"))

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
                raise RuntimeError(f"{what} returned a rank count of {vals[-1]:g} instead of {world}: "
                                   "a peer died or disconnected; this step's results are discarded")
            return vals

        try:
            ffut = guarded(comm.all_reduce(flags), what).then(host)
        except Exception as exc:  # noqa: BLE001
            ffut = torch.futures.Future()
            ffut.set_exception(RuntimeError(f"{what} failed: {exc}"))
        for i, p in enumerate(pending):
            # not collect_all: it completes at the first error, before the other future is done
            p.fut.add_done_callback(
                lambda _f, p=p, i=i: ffut.add_done_callback(lambda _g: _settle(p, i, ffut, on_nonfinite)))


def _settle(p: PendingBucket, i: int, flags_fut, on_nonfinite) -> None:
    try:
        x = p.fut.value()
        flags = flags_fut.value()
        if p.flag is not None and flags[i] > 0:
            # as with plain allreduce, the non-finite value reaches every rank; the residual
            # and store must not keep it
            x.fill_(float("nan"))
            on_nonfinite(p.bucket, p.step)
        if p.scatter is not None:
            p.scatter(x)
        p.result.set_result(x)
    except BaseException as exc:  # noqa: BLE001 - forwarded to DDP
        p.result.set_exception(exc)
