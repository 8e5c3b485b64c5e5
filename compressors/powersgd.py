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
from dataclasses import dataclass

import torch

from . import cpu_kernels
from .base import Compressor
from .deferred import Deferred
from .context import check_input
from .hashrng import SHARED, stream_key, uniform
from .registry import register
from .reproducible import OUTER_BLOCK_ELEMS, outer_sum_into, tree_dot, tree_norm

__all__ = ["PowerSGD", "PowerRound", "LayerPlan", "LayerDecode", "matrix_shape", "orthogonalize_",
           "orthogonalize_batched_"]

logger = logging.getLogger(__name__)


def matrix_shape(numel: int) -> tuple[int, int]:
    """``(rows, cols)`` close to square with ``rows * cols >= numel``."""
    cols = max(1, math.isqrt(max(numel - 1, 0)) + 1) if numel > 1 else 1
    return -(-numel // cols), cols


def orthogonalize_(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p`` (``rows x r``) in place.

    Runs after the ``P`` allreduce, so it must give the same bits on every rank: dot products
    and norms are :mod:`compressors.reproducible` tree sums, never BLAS or torch reductions.
    """
    return orthogonalize_batched_(p.unsqueeze(0), eps).squeeze(0)


def orthogonalize_batched_(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the columns of every matrix of ``p`` (``k x rows x r``) in place.

    Rank-reproducible (see :func:`orthogonalize_`): only elementwise ops in a fixed order."""
    for i in range(p.shape[2]):
        col = p[:, :, i]
        for j in range(i):
            pj = p[:, :, j]
            col.sub_(tree_dot(col, pj) * pj)
        col.div_(tree_norm(col) + eps)
    return p


@dataclass(frozen=True)
class _Group:
    """Same-shape matrices of a bucket, factorized as one batch."""

    rows: int
    cols: int
    r: int
    offsets: tuple  # element offsets of the matrices in the flat bucket
    p_pos: int  # where this group's P (k x rows x r) starts in the P buffer
    q_pos: int  # where its Q (stored transposed: k x r x cols) starts in the Q buffer
    spacing: int  # constant distance between the matrices (as_strided batch), else 0

    @property
    def k(self) -> int:
        return len(self.offsets)


@dataclass(frozen=True)
class LayerPlan:
    """How a bucket of known tensor shapes is factorized (see the module docstring).

    Attributes:
        groups: same-shape matrices, batched.
        dense: ``(offset, numel)`` of the tensors sent uncompressed, in bucket order.
        p_numel: elements of the P buffer.
        q_numel: elements of the Q factors (the uncompressed elements follow them).
        dense_numel: uncompressed elements.
    """

    groups: tuple
    dense: tuple
    p_numel: int
    q_numel: int
    dense_numel: int


def _batch(x: torch.Tensor, g: _Group) -> torch.Tensor:
    """The ``k x rows x cols`` matrices of group ``g`` in flat fp32 ``x`` (a view when spaced)."""
    rc = g.rows * g.cols
    if g.k == 1:
        return x[g.offsets[0]: g.offsets[0] + rc].view(1, g.rows, g.cols)
    if g.spacing:
        return x.as_strided((g.k, g.rows, g.cols), (g.spacing, g.cols, 1),
                            x.storage_offset() + g.offsets[0])
    return torch.stack([x[o: o + rc].view(g.rows, g.cols) for o in g.offsets])


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
        if shapes in cache:
            return cache[shapes]
        by_shape: dict[tuple[int, int, int], list[int]] = {}
        dense, off = [], 0
        for sh in shapes:
            n = math.prod(sh)
            rows = sh[0] if len(sh) >= 2 else 0
            cols = n // rows if rows else 0
            r = min(self.rank, rows, cols)
            if len(sh) >= 2 and r >= 1 and n >= self.min_compression_rate * r * (rows + cols):
                by_shape.setdefault((rows, cols, r), []).append(off)
            elif n:
                dense.append((off, n))
            off += n
        plan = None
        if by_shape:
            groups, p_pos, q_pos = [], 0, 0
            for (rows, cols, r), offs in by_shape.items():
                gaps = {b - a for a, b in zip(offs, offs[1:])}
                spacing = gaps.pop() if len(gaps) == 1 else 0
                groups.append(_Group(rows, cols, r, tuple(offs), p_pos, q_pos, spacing))
                p_pos += len(offs) * rows * r
                q_pos += len(offs) * cols * r
            plan = LayerPlan(tuple(groups), tuple(dense), p_pos, q_pos, sum(n for _, n in dense))
        cache[shapes] = plan
        return plan

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

    def _layer_p(self, xf, plan: LayerPlan, q: torch.Tensor):
        """``P = M Q`` of every matrix into one fresh fp32 buffer; returns (buffer, batches)."""
        pbuf = torch.empty(plan.p_numel, dtype=torch.float32, device=xf.device)
        mats = []
        for g in plan.groups:
            m = _batch(xf, g)
            mats.append(m)
            torch.bmm(m, self._qv(q, g).transpose(1, 2), out=self._pv(pbuf, g))
        return pbuf, mats

    @staticmethod
    def _pv(pbuf, g):
        return pbuf[g.p_pos: g.p_pos + g.k * g.rows * g.r].view(g.k, g.rows, g.r)

    @staticmethod
    def _qv(qbuf, g):
        # Q is kept transposed (k x r x cols): Q^T = P^T M and P Q^T then read and write
        # rows of the bucket in order (measured 2-4x faster than M^T P on CPU)
        return qbuf[g.q_pos: g.q_pos + g.k * g.cols * g.r].view(g.k, g.r, g.cols)

    def _layer_q(self, xf, plan: LayerPlan, mats, pbuf) -> torch.Tensor:
        """Orthogonalize ``P`` in place, then ``Q = M^T P`` of every matrix followed by the
        uncompressed elements, in one fresh fp32 buffer."""
        qbuf = torch.empty(plan.q_numel + plan.dense_numel, dtype=torch.float32, device=xf.device)
        for g, m in zip(plan.groups, mats):
            p = orthogonalize_batched_(self._pv(pbuf, g))
            torch.bmm(p.transpose(1, 2), m, out=self._qv(qbuf, g))
        pos = plan.q_numel
        for o, n in plan.dense:
            qbuf[pos: pos + n].copy_(xf[o: o + n])
            pos += n
        return qbuf

    def _outer_scratch(self, cols: int, device) -> torch.Tensor:
        return self.workspace().get("outer", 2 * max(OUTER_BLOCK_ELEMS, cols), torch.float32, device)

    def _layer_decode(self, plan: LayerPlan, pbuf, qbuf, ctx, dense_src=None,
                      out=None) -> torch.Tensor:
        """``P Q^T`` of every matrix, and the uncompressed elements (from ``qbuf`` after its
        factors, or from ``dense_src``), into a fresh flat tensor of ``ctx.dtype`` (or into
        ``out``, flat and contiguous, of ``ctx.dtype``).

        The aggregate must be bitwise equal on every rank, so the products are summed in a
        fixed order (:func:`outer_sum_into`), never by BLAS; this rank's own part (for error
        feedback) is decoded the same way, so that at world size 1 it equals the aggregate."""
        if out is None:  # reused memory once unreferenced (a fresh one page-faults: twice a step)
            out = self.payload_pool().empty(ctx.numel, ctx.dtype, pbuf.device)
        for g in plan.groups:
            p, q = self._pv(pbuf, g), self._qv(qbuf, g)
            rc = g.rows * g.cols
            scratch = self._outer_scratch(g.cols, pbuf.device)
            for i, o in enumerate(g.offsets):  # straight into the output: no batch temp
                outer_sum_into(out[o: o + rc].view(g.rows, g.cols), p[i], q[i], scratch)
        pos = plan.q_numel
        for o, n in plan.dense:
            out[o: o + n].copy_(dense_src[o: o + n] if dense_src is not None else qbuf[pos: pos + n])
            pos += n
        return out

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
            pbuf, mats = self._layer_p(xf, plan, self._initial_q_layers(ctx, plan))
            return [pbuf, self._layer_q(xf, plan, mats, pbuf)]
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
            return self._layer_decode(self.layer_plan(shapes), p, q, ctx)
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
            pbuf, mats = self._layer_p(xf, plan, q)
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
            return self._layer_q(rnd.xf, rnd.plan, rnd.mats, rnd.p)
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
            return self._layer_decode(rnd.plan, rnd.p, q_payload, rnd.ctx,
                                      dense_src=rnd.x.reshape(-1) if own else None)
        return self._flat_decode(rnd.p, q_payload, rnd.ctx)

    def deferred_decode(self, rnd: "PowerRound", q_payload: torch.Tensor,
                        own: bool = False) -> "Deferred":
        """:meth:`decode_round` not yet written anywhere (a :class:`LayerDecode`); the per-layer
        form of an fp32 bucket only (else the decode, materialized now)."""
        if rnd.plan is None or rnd.ctx.dtype != torch.float32:
            return _Materialized(self.decode_round(rnd, q_payload, own))
        return LayerDecode(self, rnd, q_payload, own)

    def keep(self, rnd: "PowerRound", q_payload: torch.Tensor, store: dict) -> None:
        """Remember the summed factors in ``store`` (warm start next step, checkpointed)."""
        store["powersgd_p"] = rnd.p
        store["powersgd_q"] = self.q_factors(rnd, q_payload).clone()


class PowerRound:
    """One bucket's power iteration between the two allreduces (see :meth:`PowerSGD.first_round`).

    Attributes:
        ctx, x: the bucket's context and flat input.
        p: the ``P`` payload (fp32; the caller sums it in place).
        plan, mats, xf: per-layer form (``plan`` is a :class:`LayerPlan`), else ``None``.
        m: flat form: the zero-padded ``rows x cols`` fp32 matrix, else ``None``.
    """

    __slots__ = ("ctx", "x", "p", "plan", "mats", "xf", "m")

    def __init__(self, ctx, x, p, *, plan=None, mats=None, xf=None, m=None):
        self.ctx, self.x, self.p, self.plan, self.mats, self.xf, self.m = ctx, x, p, plan, mats, xf, m


class _Materialized(Deferred):
    """A decode that was materialized when it was asked for (the paths without a fused form)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t

    def materialize(self) -> torch.Tensor:
        return self.t


class LayerDecode(Deferred):
    """``P Q^T`` of a per-layer fp32 round (plus the uncompressed elements), written only when
    the hook says where: :meth:`into_` straight into the bucket, :meth:`residual_` as
    ``x - P Q^T`` in one compiled pass per matrix (``cp_outer_residual``) without the decoded
    temporary. The bits of :meth:`PowerSGD.decode_round` (``test_powersgd_deferred_decode``)."""

    __slots__ = ("c", "rnd", "qbuf", "own")

    def __init__(self, c: PowerSGD, rnd: "PowerRound", qbuf: torch.Tensor, own: bool):
        self.c, self.rnd, self.qbuf, self.own = c, rnd, qbuf, own

    def _dense_src(self):
        return self.rnd.x.reshape(-1) if self.own else None

    def materialize(self) -> torch.Tensor:
        return self.c._layer_decode(self.rnd.plan, self.rnd.p, self.qbuf, self.rnd.ctx, self._dense_src())

    def into_(self, out: torch.Tensor) -> torch.Tensor:
        flat = out.view(-1) if out.is_contiguous() else None
        if flat is None or out.dtype != torch.float32 or flat.numel() != self.rnd.ctx.numel:
            return out.copy_(self.materialize())
        self.c._layer_decode(self.rnd.plan, self.rnd.p, self.qbuf, self.rnd.ctx, self._dense_src(), out=flat)
        return out

    def residual_(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        ck = cpu_kernels.lib(x, r, self.rnd.p, self.qbuf)
        if (ck is None or x.dtype != torch.float32 or r.dtype != torch.float32
                or not (x.is_contiguous() and r.is_contiguous())):
            return super().residual_(x, r)
        plan, xf, rf = self.rnd.plan, x.view(-1), r.view(-1)
        nth = cpu_kernels.threads()
        for g in plan.groups:
            p, q = self.c._pv(self.rnd.p, g), self.c._qv(self.qbuf, g)
            rc = g.rows * g.cols
            for i, o in enumerate(g.offsets):
                pi, qi = p[i], q[i]  # rows x r and r x cols, row-major views
                if not (pi.is_contiguous() and qi.is_contiguous()):
                    pi, qi = pi.contiguous(), qi.contiguous()
                ck.cp_outer_residual(xf[o:].data_ptr(), rf[o:].data_ptr(), g.rows, g.cols,
                                     g.r, pi.data_ptr(), qi.data_ptr(), nth)
        pos = plan.q_numel
        for o, n in plan.dense:  # own: those elements went as they are (x - x); else from Q
            src = xf[o: o + n] if self.own else self.qbuf[pos: pos + n]
            torch.sub(xf[o: o + n], src, out=rf[o: o + n])
            pos += n
        return r

    def into_with_residual_(self, own: Deferred, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """The residual ``x - own`` and this aggregate written into ``x`` in one compiled pass
        per matrix (``cp_outer_residual_into``): ``x`` is read and written once. The bits of
        ``own.residual_(x, r)`` then ``self.into_(x)``."""
        ck = cpu_kernels.lib(x, r, self.rnd.p, self.qbuf)
        if (ck is None or not isinstance(own, LayerDecode) or own.rnd is not self.rnd or self.own
                or x.dtype != torch.float32 or r.dtype != torch.float32
                or not (x.is_contiguous() and r.is_contiguous()) or x.numel() != self.rnd.ctx.numel):
            return super().into_with_residual_(own, x, r)
        plan, xf, rf = self.rnd.plan, x.view(-1), r.view(-1)
        nth = cpu_kernels.threads()
        for g in plan.groups:
            p, qo, qs = self.c._pv(self.rnd.p, g), self.c._qv(own.qbuf, g), self.c._qv(self.qbuf, g)
            for i, o in enumerate(g.offsets):
                pi, qoi, qsi = (t if t.is_contiguous() else t.contiguous() for t in (p[i], qo[i], qs[i]))
                ck.cp_outer_residual_into(xf[o:].data_ptr(), rf[o:].data_ptr(), g.rows, g.cols,
                                          g.r, pi.data_ptr(), qoi.data_ptr(), qsi.data_ptr(), nth)
        pos = plan.q_numel
        for o, n in plan.dense:  # the residual reads x before the aggregate overwrites it
            src = xf[o: o + n] if own.own else own.qbuf[pos: pos + n]
            torch.sub(xf[o: o + n], src, out=rf[o: o + n])
            xf[o: o + n].copy_(self.qbuf[pos: pos + n])
            pos += n
        return x
