"""``PowerSGD``: rank-r approximation by one power iteration (Vogels et al., 2019), linear family.

The flat bucket of ``n`` elements is viewed as a matrix ``M`` of ``rows x cols`` with
``cols = ceil(sqrt(n))``, ``rows = ceil(n / cols)`` (zero-padded; close to square, which is
what makes the factors small). One step, with ``Q`` (``cols x r``) shared by every rank:

1. ``P = M Q``; allreduce ``P`` (sum); orthogonalize its columns (Gram-Schmidt) — every rank
   holds the same summed bits, so the orthogonalization is identical everywhere;
2. ``Q = M^T P``; allreduce ``Q``; the aggregate is ``P Q^T``.

``own = P (M^T P)^T`` (this rank's part of the aggregate) feeds the caller's error feedback;
``Q`` is kept (warm start) in the per-bucket ``store`` as ``store["powersgd_q"]`` together
with ``store["powersgd_p"]``, so both checkpoint with the hook state and a changed bucket
layout re-initializes them. A bucket whose factors would not be at least
``min_compression_rate`` times smaller than the bucket is sent dense.

The compressor only does the math (``first_round`` -> sum ``P`` -> ``second_round`` -> sum
``Q`` -> ``decode_round``); ``comms.algorithms.allreduce`` runs the two allreduces, both
issued from the caller's thread (torch's ``powerSGD_hook`` issues the second from a
completion callback, where it races with the next bucket's first allreduce and mismatches
collectives on gloo). What runs after a sum (Gram-Schmidt, ``P Q^T``) is rank-reproducible:
fixed-order elementwise arithmetic from :mod:`compressors.reproducible`, never BLAS.

**Per layer.** When ``ctx.shapes`` is known (the hook passes a DDP bucket's parameter
shapes), every tensor with >= 2 dims is its own matrix (``rows = shape[0]``,
``cols = prod(shape[1:])``), as in torch's ``powerSGD_hook``: a low-rank approximation of a
reshaped concatenation of layers has no structure, one of each weight matrix does. Matrices
of the same shape are multiplied as one batch (``torch.bmm``; views into the bucket, no copy,
when they sit at equal spacing in it, as repeated layers do). 1-D tensors and matrices whose
factors would not be ``min_compression_rate`` times smaller go uncompressed. Still exactly two
allreduces per bucket: all ``P`` s in one fp32 buffer, then all ``Q`` s followed by the
uncompressed elements (as fp32) in the second. Payload of :meth:`compress` with shapes:
``[P_all, Q_all ++ uncompressed]``, flat fp32, groups in order of first appearance of their
shape, matrices in bucket order within a group.

Example::

    >>> state = comms.register(ddp_model, "powersgd:rank=2")
"""

from __future__ import annotations

import logging
import math

import torch

from .base import Compressor
from .context import check_input
from .deferred import Deferred
from .hashrng import SHARED, stream_key, uniform
from .powersgd_layers import (LayerDecode, LayerPlan, MaterializedDecode, PowerRound,
                              build_layer_plan, layer_decode_into, layer_p, layer_q,
                              matrix_shape, orthogonalize_)
from .registry import register
from .reproducible import OUTER_BLOCK_ELEMS, outer_sum_into

__all__ = ["PowerSGD"]

logger = logging.getLogger(__name__)


@register("powersgd")
class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with warm start (allreduce family, two rounds).

    Args:
        rank: rank of the approximation (columns of ``P`` and ``Q``), >= 1.
        warm_start: reuse last step's aggregated ``Q`` (else a fresh shared random ``Q``).
        min_compression_rate: send buckets dense unless ``n >= rate * r * (rows + cols)``.

    Biased: use error feedback (the hook turns it on by default). With SGD momentum the
    optimizer keeps it (``momentum_correction = False``: ``register(..., optimizer=opt)``
    leaves the optimizer alone), as in the PowerSGD paper and torch's hook: momentum applied
    to the local gradient before a rank-1 projection, with its residual, over-applies the
    untransmitted part (the residual and the velocity both keep it) and was measured worse.

    .. warning::
        Every rank must call with the same buckets in the same order (the hook does):
        ``Q`` is shared state that must stay identical on every rank.
    """

    name = "powersgd"
    families = ("allreduce",)
    momentum_correction = False  # the optimizer's momentum on the decoded average
    allreduce_rounds = 2  # the power-iteration protocol: first_round / second_round / decode_round

    @classmethod
    def examples(cls):
        return [cls(rank=2)]

    def __init__(self, rank: int = 1, warm_start: bool = True, min_compression_rate: float = 2.0):
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {rank!r}")
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank!r}")
        if not isinstance(warm_start, bool):
            raise TypeError(f"warm_start must be a bool, got {warm_start!r}")
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)):
            raise TypeError(f"min_compression_rate must be a number, got {min_compression_rate!r}")
        if not min_compression_rate >= 1:
            raise ValueError(f"min_compression_rate must be >= 1, got {min_compression_rate!r}")
        self.rank = rank
        self.warm_start = warm_start
        self.min_compression_rate = float(min_compression_rate)

    def config(self):
        return {"rank": self.rank, "warm_start": self.warm_start,
                "min_compression_rate": self.min_compression_rate}

    # -- shapes and accounting -------------------------------------------------------
    def plan(self, numel: int) -> tuple[int, int, int] | None:
        """``(rows, cols, r)``, or ``None`` when the bucket goes dense."""
        rows, cols = matrix_shape(numel)
        r = min(self.rank, rows, cols)
        if numel < 2 or numel < self.min_compression_rate * r * (rows + cols):
            return None
        return rows, cols, r

    def wire_bytes(self, numel, dtype=torch.float32):
        pl = self.plan(numel)
        if pl is None:
            return numel * dtype.itemsize
        rows, cols, r = pl
        return 4 * r * (rows + cols)  # fp32 P and Q, each allreduced once

    def layer_plan(self, shapes) -> LayerPlan | None:
        """The per-layer plan for tensors of ``shapes`` (in bucket order), or ``None`` when no
        matrix is worth factorizing (the bucket goes dense). Memoised per shapes."""
        shapes = tuple(tuple(int(d) for d in sh) for sh in shapes)
        cache = self.__dict__.setdefault("_layer_plans", {})
        if shapes not in cache:
            cache[shapes] = build_layer_plan(shapes, self.rank, self.min_compression_rate)
        return cache[shapes]

    def shaped_wire_bytes(self, shapes, dtype=torch.float32) -> int:
        """Bytes on the wire for a bucket of tensors of ``shapes`` (both allreduces, before the
        ring factor): fp32 factors and uncompressed elements, or the dense bucket."""
        plan = self.layer_plan(shapes)
        if plan is None:
            return sum(math.prod(sh) for sh in shapes) * dtype.itemsize
        return 4 * (plan.p_numel + plan.q_numel + plan.dense_numel)

    def _initial_q_layers(self, ctx, plan: LayerPlan) -> torch.Tensor:
        key = stream_key(ctx.seed, 0 if self.warm_start else ctx.step, ctx.bucket, SHARED)
        return uniform(plan.q_numel, key, device=ctx.device).sub_(0.5)

    def _outer_scratch(self, cols: int, device) -> torch.Tensor:
        return self.workspace().get("outer", 2 * max(OUTER_BLOCK_ELEMS, cols), torch.float32, device)

    def decode_layers(self, plan: LayerPlan, pbuf, qbuf, ctx, dense_src=None,
                      out=None) -> torch.Tensor:
        """``P Q^T`` of every matrix, and the uncompressed elements (from ``qbuf`` after its
        factors, or from ``dense_src``), into a fresh flat tensor of ``ctx.dtype`` (or into
        ``out``, flat and contiguous, of ``ctx.dtype``); rank-reproducible
        (:func:`~compressors.powersgd_layers.layer_decode_into`)."""
        if out is None:  # reused memory once unreferenced (a fresh one page-faults: twice a step)
            out = self.payload_pool().empty(ctx.numel, ctx.dtype, pbuf.device)
        return layer_decode_into(out, plan, pbuf, qbuf,
                                 lambda cols: self._outer_scratch(cols, pbuf.device), dense_src)

    # -- local round trip (no communication): one power iteration on this rank's M -----
    def _matrix(self, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        n = x.numel()
        if n == rows * cols and x.dtype == torch.float32:
            return x.reshape(rows, cols)
        m = torch.zeros(rows * cols, dtype=torch.float32, device=x.device)
        m[:n] = x
        return m.view(rows, cols)

    def _initial_q(self, ctx, cols: int, r: int) -> torch.Tensor:
        # shared stream: the same Q on every rank; a fresh one per step without warm start
        key = stream_key(ctx.seed, 0 if self.warm_start else ctx.step, ctx.bucket, SHARED)
        return uniform(cols * r, key, device=ctx.device).sub_(0.5).view(cols, r)

    def compress(self, x, ctx):
        check_input(x)
        x = x.detach()  # the decode writes with out= ops, which autograd refuses
        shapes = ctx.known_shapes()
        if shapes:
            plan = self.layer_plan(shapes)
            if plan is None:
                return [x.reshape(-1)]
            xf = x.reshape(-1).float()
            pbuf, mats = layer_p(xf, plan, self._initial_q_layers(ctx, plan))
            return [pbuf, layer_q(xf, plan, mats, pbuf)]
        pl = self.plan(x.numel())
        if pl is None:
            return [x.reshape(-1)]
        rows, cols, r = pl
        m = self._matrix(x, rows, cols)
        p = orthogonalize_(m @ self._initial_q(ctx, cols, r))
        return [p, m.t() @ p]

    def decompress(self, payload, ctx):
        if len(payload) == 1:
            return payload[0].to(ctx.dtype)
        p, q = payload
        shapes = ctx.known_shapes()
        if shapes:
            return self.decode_layers(self.layer_plan(shapes), p, q, ctx)
        return self._flat_decode(p, q, ctx)

    def _flat_decode(self, p, q, ctx) -> torch.Tensor:
        """``P Q^T`` of the flat matrix in a fixed summation order (rank-reproducible)."""
        m = torch.empty(p.shape[0], q.shape[0], dtype=torch.float32, device=p.device)
        outer_sum_into(m, p, q.t(), self._outer_scratch(q.shape[0], p.device))
        return m.reshape(-1)[: ctx.numel].to(ctx.dtype)

    def error_bound(self, x):
        # a projection: |error_ij| <= ||M - P P^T M||_F <= ||M||_F (dense buckets: exact)
        if self.plan(x.numel()) is None:
            return x.new_zeros(x.shape)
        return torch.linalg.vector_norm(x.float()).expand(x.shape).to(x.dtype)

    # -- the two-round protocol (driven by comms.algorithms.allreduce) ----------------
    # Pure tensor math: the caller sums ``round.p`` over ranks (in place) between
    # ``first_round`` and ``second_round``, and the returned Q payload after it.
    def first_round(self, x, ctx, store) -> "PowerRound | None":
        """``P = M Q`` (``Q`` warm-started from ``store``); ``None``: the bucket goes dense."""
        check_input(x)
        x = x.detach()
        shapes = ctx.known_shapes()
        if shapes:
            plan = self.layer_plan(shapes)
            if plan is None:
                return None
            xf = x.reshape(-1)
            if xf.dtype != torch.float32:
                xf = xf.float()
            q = store.get("powersgd_q")
            if (not self.warm_start or q is None or q.numel() != plan.q_numel
                    or q.dtype != torch.float32 or q.device != x.device):
                q = self._initial_q_layers(ctx, plan)
            pbuf, mats = layer_p(xf, plan, q)
            return PowerRound(ctx, x, pbuf, plan=plan, mats=mats, xf=xf)
        pl = self.plan(x.numel())
        if pl is None:
            return None
        rows, cols, r = pl
        m = self._matrix(x, rows, cols)
        q = store.get("powersgd_q")
        if (not self.warm_start or q is None or tuple(q.shape) != (cols, r)
                or q.dtype != torch.float32 or q.device != x.device):
            q = self._initial_q(ctx, cols, r)
        return PowerRound(ctx, x, m @ q, m=m)

    def second_round(self, rnd: "PowerRound") -> torch.Tensor:
        """After ``rnd.p`` holds the sum over ranks: orthogonalize it (rank-reproducibly) and
        return the fresh Q payload (per layer: the Q factors followed by the uncompressed
        elements, summed together)."""
        if rnd.plan is not None:
            return layer_q(rnd.xf, rnd.plan, rnd.mats, rnd.p)
        orthogonalize_(rnd.p)
        return rnd.m.t() @ rnd.p

    def q_factors(self, rnd: "PowerRound", q_payload: torch.Tensor) -> torch.Tensor:
        """The Q factors of a Q payload (a view)."""
        return q_payload[: rnd.plan.q_numel] if rnd.plan is not None else q_payload

    def decode_round(self, rnd: "PowerRound", q_payload: torch.Tensor, own: bool = False) -> torch.Tensor:
        """``P Q^T`` (+ the uncompressed elements) as a fresh flat tensor of the bucket dtype;
        ``own``: ``q_payload`` holds this rank's factors only and the uncompressed elements
        come from its own bucket. Rank-reproducible (fixed summation order)."""
        if rnd.plan is not None:
            return self.decode_layers(rnd.plan, rnd.p, q_payload, rnd.ctx,
                                      dense_src=rnd.x.reshape(-1) if own else None)
        return self._flat_decode(rnd.p, q_payload, rnd.ctx)

    def deferred_decode(self, rnd: "PowerRound", q_payload: torch.Tensor,
                        own: bool = False) -> "Deferred":
        """:meth:`decode_round` not yet written anywhere (a :class:`LayerDecode`); the per-layer
        form of an fp32 bucket only (else the decode, materialized now)."""
        if rnd.plan is None or rnd.ctx.dtype != torch.float32:
            return MaterializedDecode(self.decode_round(rnd, q_payload, own))
        return LayerDecode(self, rnd, q_payload, own)

    def keep(self, rnd: "PowerRound", q_payload: torch.Tensor, store: dict) -> None:
        """Remember the summed factors in ``store`` (warm start next step, checkpointed)."""
        store["powersgd_p"] = rnd.p
        store["powersgd_q"] = self.q_factors(rnd, q_payload).clone()
