"""``Algorithm``: everything about one way of aggregating a bucket, in one object.

Like one collective of nccl-tests (its bytes, its bus factor, its check, its run): an
algorithm file defines a subclass and one instance, and the registry, the cost model, the
planner, the autotuner and the hook loop over instances without naming any of them.

Contract of a subclass:

* ``name`` (registry key), ``family`` (the compressor family it needs:
  ``Compressor.supports(family)``);
* ``__call__(comm, compressor, x, ctx, store, want=Want()) -> Future[(sum, own)]``: ``x`` is
  this rank's flat, fed contribution; ``sum`` the aggregate every rank receives with the same
  bits (an algorithm with ``shard = True``: this rank's chunk of it only — a reduce-scatter);
  ``own`` this rank's decoded contribution (the residual is ``x - own``); ``store`` a
  per-gradient dict of tensors/numbers persisted with the state. ``want`` (:class:`Want`) is
  what the caller needs back — the inputs every algorithm reads and honours where it can;
  either result may come back as a :class:`compressors.deferred.Deferred` written where it
  goes. Rounds are issued from the caller's thread in program order (ARCHITECTURE.md §2);
  what runs after a collective obeys ARCHITECTURE.md §5;
* ``wire_bytes(compressor, numel, dtype, world)``: bytes one rank sends for a bucket (what
  the stats report and the tests count);
* ``wire_ops(model, compressor, numel, dtype, tier)``: the collectives one bucket issues on
  ``tier`` as ``[(tier, op, wire dtype name, payload bytes)]`` (what the cost model probes);
* ``cost(model, compressor, numel, dtype, tier)``: predicted seconds on ``tier`` of a
  :class:`comms.tuning.cost_model.CostModel` (alpha-beta per collective plus measured codec time);
* ``flush_residual_(x, store, comm, numel=None)``: on a switch away from this algorithm, add
  any residual it keeps in ``store`` into ``x`` where the next aggregation counts it exactly
  once; returns whether it added one (default: keeps none);
* optional ``error_bound(compressor, xs, dtype=None)``: per-element bound of ``|sum - sum(xs)|``;
* ``holds_back``: whether the aggregate can keep back part of what a rank sent (a second
  compression after the sum, whose residual stays with one rank: two_phase's owner). Such an
  algorithm honours ``want.return_held`` (a sparsifier with error feedback): it keeps no
  residual of its own, and each sender keeps what was left out of its values
  (:meth:`~compressors.error_feedback.ErrorFeedback.update_returned_`). Otherwise the default
  momentum masking (``"held"``) zeroes the velocity only where that happened;
* ``shard``: the aggregate is this rank's chunk only (FSDP's reduce-scatter; never a planner
  candidate for a full all-reduce).

Hierarchical forms are built by composition (:class:`comms.algorithms.hierarchical.Hierarchical`
wraps any flat instance); nothing parses names.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..transport.waits import wait
from ..transport.errors import where
from . import buffers

__all__ = ["Algorithm", "DENSE", "Want", "PLAIN", "Route", "BEFORE_START", "round_wait", "decode_own", "hand_over"]

logger = logging.getLogger(__name__)

# the name of "no compression, DDP's plain allreduce" wherever a plan names an algorithm
DENSE = "dense"


@dataclass(frozen=True)
class Want:
    """What the caller needs back from one algorithm call (built once per call by
    :meth:`comms.core.stages.Delivery.want`); each algorithm honours the fields it can.

    Attributes:
        deferred: ``sum`` (and ``own``) may come back as :class:`compressors.deferred.Deferred`
            results, decoded straight where they go; ``x`` stays unchanged until then.
        own: this rank's decoded contribution is used (error feedback, masking); False: it may
            come back as None, never decoded.
        on_own: ``own`` is handed to it in the caller's thread while the last round is on the
            wire (e.g. the residual ``x - own``), and None comes back in its place.
        return_held: a sparsifier with error feedback on an algorithm that holds back: no
            owner residual; what the second stage left out stays with its sender.
        exact_own: (a reduce-scatter) this rank's own chunk is added exactly, never encoded.
        tail: (a reduce-scatter) uint8 bytes riding every payload (the non-finite flag); every
            rank's come back with the sum (``sum.tails``).
    """

    deferred: bool = False
    own: bool = True
    on_own: Callable | None = None
    return_held: bool = False
    exact_own: bool = False
    tail: torch.Tensor | None = None


#: the plain request: the sum and this rank's own contribution, both materialized
PLAIN = Want()


@dataclass(frozen=True)
class Route:
    """What runs for one gradient at one step (chosen by a router: :mod:`comms.tuning.router`).

    Attributes:
        name: an algorithm name, or ``"dense"``.
        settled: dense is the decision (not a trial's dense step, not before compression
            starts): the residual drains.
        switches: the route takes part in switch tracking (a gradient moving between
            algorithms gives the old one's kept residual back once); not before compression
            starts, not during a module's timed trials.
    """

    name: str
    settled: bool = True
    switches: bool = True


#: the route of a step before compression starts
BEFORE_START = Route(DENSE, settled=False, switches=False)


def decode_own(compressor, x, payload, ctx, deferred: bool):
    """This rank's decoded contribution: the compressor's
    :meth:`~compressors.base.Compressor.deferred_own` when ``deferred`` and it has one, else
    the payload decoded now (into a reused buffer)."""
    own = compressor.deferred_own(x, payload, ctx) if deferred else None
    if own is None:
        own = compressor.decompress_into(payload, ctx, buffers.empty(ctx.numel, ctx.dtype, x.device))
    return own


def hand_over(own, on_own):
    """``own`` given to ``on_own`` (e.g. the caller's residual, written while the round is on
    the wire) and None in its place; ``own`` itself when there is no ``on_own``."""
    if on_own is None or own is None:
        return own
    on_own(own)
    return None


def round_wait(comm, fut, ctx, round_name: str):
    """Wait for an intermediate round of a multi-round algorithm in the caller's thread,
    bounded by ``comm.timeout`` (a stuck peer raises ``CollectiveTimeout`` naming the round,
    the bucket and the step instead of blocking the backward forever)."""
    return wait(fut, getattr(comm, "timeout", None),
                where(comm, round_name, ctx.bucket, ctx.numel, ctx.dtype, ctx.step))


class Algorithm:
    """Base of the aggregation algorithms (see the module docstring for the contract)."""

    name: str = ""
    family: str = ""
    hierarchical: bool = False
    #: the aggregate is this rank's chunk of the sum only (a reduce-scatter)
    shard: bool = False
    #: the aggregate may leave out a coordinate a rank sent (held in a residual of the
    #: algorithm's own, e.g. two_phase's owner re-compression); see the module docstring
    holds_back: bool = False
    #: how many times a value is compressed on its way into the aggregate: 2 where a second
    #: stage compresses the partial sums again (two_phase's owners), else 1; the auto planner
    #: breaks step-time ties towards fewer (a second lossy stage never makes the sum closer)
    compress_stages: int = 1

    def __call__(self, comm, compressor, x, ctx, store, want: Want = PLAIN):
        raise NotImplementedError

    def supports(self, compressor) -> bool:
        """Whether ``compressor`` can travel with this algorithm."""
        return compressor.supports(self.family)

    def wire_bytes(self, compressor, numel: int, dtype=torch.float32, world: int = 2) -> int:
        raise NotImplementedError

    def bucket_wire_bytes(self, compressor, ctx, world: int) -> int:
        """Bytes one rank sends for the bucket of ``ctx`` (its shapes may refine the count)."""
        return self.wire_bytes(compressor, ctx.numel, ctx.dtype, world)

    def wire_ops(self, model, compressor, numel: int, dtype, tier: str = "flat") -> list:
        return []

    def cost(self, model, compressor, numel: int, dtype, tier: str = "flat") -> float:
        return math.inf  # no formula: never chosen over a predictable candidate

    def flush_residual_(self, x: torch.Tensor, store: dict, comm, numel: int | None = None) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<algorithm {self.name}>"
