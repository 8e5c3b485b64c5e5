"""``OuterSync``: communicate every ``H`` steps — a compressed, overlapped outer sync (DiLoCo).

Each replica trains ``H`` inner steps on its own gradients (no gradient collective; the inner
optimizer and its state stay local). Then, fragment by fragment (:mod:`comms.outer.fragments`),
the **pseudo-gradient** ``d = anchor - local`` — the last synced parameters minus this rank's
— goes through :func:`comms.core.engine.run` like any gradient: error feedback, the non-finite
flag, the compressor, the algorithm, this rank's share of the average. ``tau`` inner steps
later (the transfer overlaps them) the averaged ``d`` moves the synced parameters with the
outer optimizer (:mod:`comms.outer.optimizers`): every rank computes the same new ``anchor``,
bit for bit. The local parameters become the new anchor plus what this rank trained since the
fragment was sent (``tau`` = 0: the anchor itself, DiLoCo; ``tau`` > 0: Streaming DiLoCo's
overlap, the delayed update merged with the local progress made meanwhile).

What is averaged: the pseudo-gradients only. What is not: the inner optimizer's state
(momenta, Adam's moments: each rank's own, in its own checkpoint), and between syncs the local
parameters themselves (they differ by design; the synced ``anchor`` does not).
"""

from __future__ import annotations

import logging
import time

import torch

from ..algorithms import default_algorithm, get_algorithm
from ..algorithms.dense import dense_allreduce
from ..core.engine import Call, Sink, run
from ..core.gradient_state import GradientState
from ..core.options import PipelineOptions
from ..core.replicas import ReplicaMismatchError, check_tensors
from ..transport.errors import where
from ..transport.heartbeat import HEARTBEAT
from ..transport.waits import wait
from ..tuning.router import FixedRouter
from .fragments import Schedule, split_fragments
from .optimizers import OuterOptimizer, check_outer
from .passes import land_pass, send_pass

__all__ = ["OuterSync", "OuterState"]

logger = logging.getLogger(__name__)


class OuterState(GradientState):
    """The engine's state for pseudo-gradients: per fragment the residual and stats."""

    def __init__(self, options: PipelineOptions, algorithm: str):
        super().__init__(options)
        self.router = FixedRouter(algorithm)


class OuterSink(Sink):
    """The pseudo-gradient's side of the engine: the average in place, the flag in a 1-element
    all-reduce issued first; nothing is waited for here (:meth:`OuterSync.land` waits)."""

    dense = dense_allreduce

    def what(self, comm, call, label):
        x = call.x
        return where(comm, f"outer sync {label}", call.index, x.numel(), x.dtype, call.step,
                     unit=f"fragment {call.index}")

    def prepare(self, comm, call, alg, flag, delivery):
        return {}, None if flag is None else comm.all_reduce(flag.to(torch.float32).reshape(1))

    def land(self, comm, call, alg, fut, flag_fut, settle, what):
        return fut, flag_fut, settle, what


def _int(name: str, v, low: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return v


class OuterSync:
    """Communicate every ``every`` steps (see the module docstring).

    Args:
        params: the tensors synced, in order (DDP: the module's trainable parameters; HSDP:
            the local shards of the replicated module); equal on every rank at the start.
        comm: the communicator of the replicas.
        compressor: what carries the pseudo-gradient.
        every: ``H`` >= 1, inner steps between a fragment's syncs.
        fragments: ``P`` >= 1 fragments synced in turn (at most ``H``).
        delay: ``tau``, 0 <= tau < ``H``: inner steps the transfer overlaps.
        outer, outer_lr, outer_momentum: the outer optimizer (:mod:`comms.outer.optimizers`).
        algorithm: the pseudo-gradient's algorithm (``None``: the compressor's first of
            allreduce, allgather, two_phase).
        check_every: ``N`` > 0 compares the synced parameters across ranks every ``N`` syncs.
        **options: :class:`~comms.core.options.PipelineOptions` (``error_feedback``,
            ``seed``, ``timeout``, ``residual_bound``).

    Raises:
        ValueError / TypeError: a bad option, naming it, before anything is sent.
    """

    def __init__(self, params, comm, compressor, *, every: int, fragments: int = 1, delay: int = 0,
                 outer: str = "average", outer_lr=None, outer_momentum=None, algorithm: str | None = None,
                 check_every: int | None = None, **options):
        every = _int("sync_every", every, 1)
        fragments, delay = _int("sync_fragments", fragments, 1), _int("sync_delay", delay, 0)
        if delay >= every:
            raise ValueError(f"sync_delay must be < sync_every: a fragment's average lands before its "
                             f"next send; got sync_delay={delay}, sync_every={every}")
        if fragments > every:
            raise ValueError(f"sync_fragments must be <= sync_every (one fragment sent per step at "
                             f"most); got {fragments} > {every}")
        opts = PipelineOptions(compressor, start_iter=0, **options)
        check_outer(outer, outer_lr, outer_momentum, opts.compressor, opts.error_feedback)
        name = default_algorithm(opts.compressor) if algorithm in (None, "auto") else algorithm
        if not get_algorithm(name).supports(opts.compressor):
            raise ValueError(f"algorithm {name!r} cannot carry {opts.compressor.spec()!r} (it supports "
                             f"{list(opts.compressor.families)})")
        self.state, self.sink = OuterState(opts, name), OuterSink()
        self.comm, self.params = comm, list(params)
        self.schedule = Schedule(every, fragments, delay)
        self.groups = split_fragments([p.numel() for p in self.params], fragments)
        self.schedule.fragments = len(self.groups)
        self.fragment_params = [[self.params[i] for i in g] for g in self.groups]
        self.outer = OuterOptimizer(outer, outer_lr, outer_momentum)
        self.anchors = [self._flat(ps) for ps in self.fragment_params]
        # per fragment, allocated at its first send and reused: the pseudo-gradient (the engine
        # feeds and settles it in place) and what this rank held when it was sent (tau > 0).
        # Fresh 4-byte-per-parameter tensors every sync cost more than the passes themselves
        # (first-touch page faults: docs/design-notes.md, "Outer sync").
        self.buffers: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(self.groups)
        self.outer_state: list[dict] = [{} for _ in self.groups]
        self.pending: dict[int, dict] = {}
        self.t, self.syncs = 0, [0] * len(self.groups)
        self.check_every = check_every
        if comm.world_size > 1 and comm.backend in ("gloo", "nccl"):
            HEARTBEAT.start()

    # -- the optimizer's step post-hook ------------------------------------------------------
    def after_step(self, *_args) -> None:
        """After every optimizer step: land the fragments due, send the fragments due."""
        self.t += 1
        for p in sorted(q for q, f in self.pending.items() if f["land_at"] <= self.t):
            self.land(p)
        for p in self.schedule.sends(self.t):
            self.send(p)
            if self.schedule.delay == 0:
                self.land(p)

    @staticmethod
    def _flat(params: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([q.detach().reshape(-1) for q in params])

    def _buffers(self, p: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.buffers[p] is None:
            a = self.anchors[p]
            self.buffers[p] = (torch.empty_like(a), torch.empty_like(a) if self.schedule.delay else None)
        return self.buffers[p]

    def send(self, p: int) -> None:
        """Start fragment ``p``'s sync: its pseudo-gradient through the engine, not waited."""
        d, local = self._buffers(p)
        st, comm = self.state, self.comm
        # this rank's share taken and the non-finite flag's max |d| found in the same pass
        amax = send_pass(self.anchors[p], self.fragment_params[p], d, local, div=comm.world_size)
        route = st.router.route(st, comm, p, self.syncs[p], d.numel(), d.dtype)
        shapes = tuple(tuple(q.shape) for q in self.fragment_params[p])
        call = Call(p, self.syncs[p], d, route, shapes=shapes, amax=amax)
        self.pending[p] = {"handle": run(st, comm, call, self.sink), "local": local,
                           "land_at": self.t + self.schedule.delay, "sent": time.monotonic()}
        self.syncs[p] += 1

    def _average(self, p: int, inflight: dict) -> torch.Tensor:
        """Wait (within the timeout from the send) for fragment ``p``'s average; settle it."""
        if "avg" in inflight:  # restored from a checkpoint
            return inflight["avg"]
        fut, flag_fut, settle, what = inflight["handle"]
        timeout = self.comm.timeout
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - inflight["sent"]))
        avg = settle(wait(fut, left, what))
        if flag_fut is not None and bool(wait(flag_fut, left, what) > 0):
            self.state.reset_flagged_(p, True)
            avg.fill_(float("nan"))
        return avg

    def land(self, p: int) -> None:
        """Apply fragment ``p``'s averaged pseudo-gradient (see the module docstring)."""
        inflight = self.pending.pop(p)
        avg = self._average(p, inflight)
        lo, hi = torch.aminmax(avg)  # one pass; NaN propagates (isfinite().all() took four)
        step, local = None, inflight["local"]  # the plain average's step runs inside the landing pass
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):  # non-finite: keep the last synced values
            logger.warning("commpress: outer sync of fragment %d (sync %d) was not finite on some "
                           "rank: its update is skipped and every replica restarts from the last "
                           "synced parameters", p, self.syncs[p] - 1)
            local = None  # what was trained since the send is dropped too: it may hold the NaN
        elif self.outer.plain():
            step = avg
        else:
            self.outer.step_(self.anchors[p], avg, self.outer_state[p])
        # the delayed update plus what this rank trained meanwhile: each parameter moves by
        # (new synced - what it held at the send), in place (no gathered copy of the parameters)
        land_pass(self.anchors[p], step, local, self.fragment_params[p])
        self._maybe_check(p)

    def _maybe_check(self, p: int) -> None:
        if not self.check_every or self.syncs[p] % self.check_every:
            return
        try:
            check_tensors([(f"fragment {q}", a) for q, a in enumerate(self.anchors)], self.comm,
                          label="synced parameters of")
        except ReplicaMismatchError as exc:
            raise ReplicaMismatchError(f"commpress: replica check at outer sync {self.syncs[p]} of "
                                       f"fragment {p}: {exc}") from None

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain tensors and numbers, per rank: the step, each fragment's synced parameters
        (anchor), outer momentum and sync count, the pseudo-gradients' residuals, and every
        fragment in flight — its average waited for and kept with what this rank held when it
        was sent, so a resumed run applies it at the same step with the same bits."""
        for p, f in self.pending.items():
            if "avg" not in f:
                f["avg"] = self._average(p, f)
                f.pop("handle", None)
        return {"kind": "outer", "t": self.t, "syncs": list(self.syncs),
                "every": self.schedule.every, "fragments": len(self.groups), "delay": self.schedule.delay,
                "compressor": self.state.compressor.spec(), "outer": self.outer.describe(),
                "anchors": [a.clone() for a in self.anchors],
                "momentum": [s.get("momentum") for s in self.outer_state],
                "memory": self.state.memory.state_dict(),
                "pending": {int(p): {"avg": f["avg"].clone(), "local": f["local"].clone(),
                                     "land_at": int(f["land_at"])}
                            for p, f in self.pending.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` (this rank's own); validates before changing anything.

        Raises:
            TypeError: not such a dict. ValueError: saved with another schedule, compressor,
                outer optimizer or parameter layout."""
        if not isinstance(sd, dict) or sd.get("kind") != "outer":
            raise TypeError(f"load_state_dict needs a dict from OuterSync.state_dict(), got {type(sd).__name__}")
        mine = {"every": self.schedule.every, "fragments": len(self.groups), "delay": self.schedule.delay,
                "compressor": self.state.compressor.spec(), "outer": self.outer.describe()}
        for key, v in mine.items():
            if sd.get(key) != v:
                raise ValueError(f"outer sync state was saved with {key}={sd.get(key)!r}, this run uses {v!r}")
        sizes = [a.numel() for a in self.anchors]
        if [a.numel() for a in sd["anchors"]] != sizes:
            raise ValueError(f"outer sync state holds fragments of {[a.numel() for a in sd['anchors']]} "
                             f"elements, this model {sizes}")
        self.t, self.syncs = int(sd["t"]), [int(s) for s in sd["syncs"]]
        for a, saved in zip(self.anchors, sd["anchors"]):
            a.copy_(saved)
        self.outer_state = [{} if m is None else {"momentum": m.clone()} for m in sd["momentum"]]
        self.state.memory.load_state_dict(sd["memory"])
        self.pending = {int(p): {"avg": f["avg"].clone(), "local": f["local"].clone(), "land_at": int(f["land_at"])}
                        for p, f in sd["pending"].items()}

    def report(self) -> str:
        """One line: the schedule, the outer optimizer, bytes per sync against dense."""
        wire, dense = self.state.wire_bytes_per_step(), self.state.dense_bytes_per_step()
        return (f"outer sync every {self.schedule.every} steps in {len(self.groups)} fragment(s), "
                f"{self.schedule.delay} step(s) overlapped, {self.outer.describe()}, "
                f"{self.state.compressor.spec()} over {self.state.router.name}: {wire} of {dense} "
                f"bytes per round of fragments; syncs {self.syncs}")
