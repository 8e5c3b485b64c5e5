"""``Algorithm``: everything about one way of aggregating a bucket, in one object.

Like one collective of nccl-tests (its bytes, its bus factor, its check, its run): an
algorithm file defines a subclass and one instance, and the registry, the cost model, the
planner, the autotuner and the hook loop over instances without naming any of them.

Contract of a subclass:

* ``name`` (registry key), ``family`` (the compressor family it needs:
  ``Compressor.supports(family)``);
* ``__call__(comm, compressor, x, ctx, store) -> Future[(sum, own)]``: ``x`` is this rank's
  flat, averaged-by-world, error-fed bucket; ``sum`` the aggregate every rank receives with
  the same bits; ``own`` this rank's decoded contribution (the hook's residual is
  ``x - own``); ``store`` a per-bucket dict of tensors/numbers persisted with the hook state.
  Rounds are issued from the caller's thread in program order (ARCHITECTURE.md §2); what
  runs after a collective obeys ARCHITECTURE.md §5;
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
  algorithm takes ``return_held=True`` (the hook passes it for a sparsifier with error
  feedback): it keeps no residual of its own, and each sender keeps what was left out of its
  values (:meth:`~compressors.error_feedback.ErrorFeedback.update_returned_`). Otherwise the
  hook's default momentum masking (``"held"``) zeroes the velocity only where that happened.

Hierarchical forms are built by composition (:class:`comms.algorithms.hierarchical.Hierarchical`
wraps any flat instance); nothing parses names.
"""

from __future__ import annotations

import logging
import math

import torch

from ..transport.waits import wait
from ..transport.errors import where
from . import buffers

__all__ = ["Algorithm", "DENSE", "round_wait", "decode_own", "hand_over"]

logger = logging.getLogger(__name__)

# the name of "no compression, DDP's plain allreduce" wherever a plan names an algorithm
DENSE = "dense"


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
    #: ``__call__`` takes ``deferred=True`` and may then return ``(sum, own)`` as
    #: :class:`compressors.base.Deferred` results (written by the hook where they go), and
    #: ``own=False``, when the caller does not use ``own`` (which may then come back None)
    deferred_results: bool = False
    #: the aggregate may leave out a coordinate a rank sent (held in a residual of the
    #: algorithm's own, e.g. two_phase's owner re-compression); see the module docstring
    holds_back: bool = False
    #: how many times a value is compressed on its way into the aggregate: 2 where a second
    #: stage compresses the partial sums again (two_phase's owners), else 1; the auto planner
    #: breaks step-time ties towards fewer (a second lossy stage never makes the sum closer)
    compress_stages: int = 1

    def __call__(self, comm, compressor, x, ctx, store):
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
