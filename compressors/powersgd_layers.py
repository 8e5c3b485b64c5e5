"""PowerSGD's factor math: close-to-square matrix shapes, the shared starting ``Q``,
rank-reproducible Gram-Schmidt, the per-layer plan of a bucket (same-shape matrices batched)
and its decode, and one bucket's power iteration between its two allreduces
(:class:`PowerRound`) with its deferred decode (:class:`LayerDecode`).
:class:`compressors.PowerSGD` drives them (see its module docstring); the flat form of a bucket
without shapes is :mod:`compressors.powersgd_flat`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import cpu_kernels
from .deferred import Deferred
from .hashrng import SHARED, stream_key, uniform
from .memory import PayloadPool, Workspace
from .reproducible import OUTER_BLOCK_ELEMS, outer_sum_into, tree_dot, tree_norm

if TYPE_CHECKING:
    from .powersgd import PowerSGD

__all__ = ["matrix_shape", "starting_q", "outer_scratch", "orthogonalize_", "orthogonalize_batched_",
           "LayerGroup", "LayerPlan", "build_layer_plan", "batch_view", "p_view", "q_view", "layer_p",
           "layer_q", "layer_decode_into", "layer_decode", "PowerRound", "MaterializedDecode",
           "LayerDecode"]


def matrix_shape(numel: int) -> tuple[int, int]:
    """``(rows, cols)`` close to square with ``rows * cols >= numel``."""
    cols = max(1, math.isqrt(max(numel - 1, 0)) + 1) if numel > 1 else 1
    return -(-numel // cols), cols


def starting_q(ctx, warm_start: bool, numel: int) -> torch.Tensor:
    """The ``Q`` factors a bucket starts from (flat, ``numel`` elements, uniform in
    [-0.5, 0.5)): the shared stream, so every rank holds the same ``Q``; with ``warm_start``
    one stream for every step (later steps start from the kept sum), else a fresh one per step."""
    key = stream_key(ctx.seed, 0 if warm_start else ctx.step, ctx.bucket, SHARED)
    return uniform(numel, key, device=ctx.device).sub_(0.5)


def outer_scratch(ws: Workspace, cols: int, device) -> torch.Tensor:
    """:func:`outer_sum_into`'s scratch for ``cols`` columns from ``ws``, sized so that it is
    never grown (at most two row blocks of ``max(OUTER_BLOCK_ELEMS, cols)`` elements)."""
    return ws.get("outer", 2 * max(OUTER_BLOCK_ELEMS, cols), torch.float32, device)


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
class LayerGroup:
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


def batch_view(x: torch.Tensor, g: LayerGroup) -> torch.Tensor:
    """The ``k x rows x cols`` matrices of group ``g`` in flat fp32 ``x`` (a view when spaced)."""
    rc = g.rows * g.cols
    if g.k == 1:
        return x[g.offsets[0]: g.offsets[0] + rc].view(1, g.rows, g.cols)
    if g.spacing:
        return x.as_strided((g.k, g.rows, g.cols), (g.spacing, g.cols, 1),
                            x.storage_offset() + g.offsets[0])
    return torch.stack([x[o: o + rc].view(g.rows, g.cols) for o in g.offsets])



def build_layer_plan(shapes: tuple, rank: int, min_compression_rate: float) -> LayerPlan | None:
    """The per-layer plan for tensors of ``shapes`` (int tuples, in bucket order): every tensor
    with >= 2 dims whose rank-``rank`` factors are ``min_compression_rate`` times smaller is a
    matrix, same shapes batched; the rest go uncompressed. ``None``: no matrix is worth it."""
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    dense, off = [], 0
    for sh in shapes:
        n = math.prod(sh)
        rows = sh[0] if len(sh) >= 2 else 0
        cols = n // rows if rows else 0
        r = min(rank, rows, cols)
        if len(sh) >= 2 and r >= 1 and n >= min_compression_rate * r * (rows + cols):
            by_shape.setdefault((rows, cols, r), []).append(off)
        elif n:
            dense.append((off, n))
        off += n
    if not by_shape:
        return None
    groups, p_pos, q_pos = [], 0, 0
    for (rows, cols, r), offs in by_shape.items():
        gaps = {b - a for a, b in zip(offs, offs[1:])}
        spacing = gaps.pop() if len(gaps) == 1 else 0
        groups.append(LayerGroup(rows, cols, r, tuple(offs), p_pos, q_pos, spacing))
        p_pos += len(offs) * rows * r
        q_pos += len(offs) * cols * r
    return LayerPlan(tuple(groups), tuple(dense), p_pos, q_pos, sum(n for _, n in dense))


def p_view(pbuf: torch.Tensor, g: LayerGroup) -> torch.Tensor:
    """Group ``g``'s ``P`` factors (``k x rows x r``) in the P buffer."""
    return pbuf[g.p_pos: g.p_pos + g.k * g.rows * g.r].view(g.k, g.rows, g.r)


def q_view(qbuf: torch.Tensor, g: LayerGroup) -> torch.Tensor:
    """Group ``g``'s ``Q`` factors, stored transposed (``k x r x cols``)."""
    # transposed: Q^T = P^T M and P Q^T then read and write rows of the bucket in order
    # (measured 2-4x faster than M^T P on CPU)
    return qbuf[g.q_pos: g.q_pos + g.k * g.cols * g.r].view(g.k, g.r, g.cols)


def layer_p(xf: torch.Tensor, plan: LayerPlan, q: torch.Tensor):
    """``P = M Q`` of every matrix into one fresh fp32 buffer; returns (buffer, batches)."""
    pbuf = torch.empty(plan.p_numel, dtype=torch.float32, device=xf.device)
    mats = []
    for g in plan.groups:
        m = batch_view(xf, g)
        mats.append(m)
        torch.bmm(m, q_view(q, g).transpose(1, 2), out=p_view(pbuf, g))
    return pbuf, mats


def layer_q(xf: torch.Tensor, plan: LayerPlan, mats, pbuf: torch.Tensor) -> torch.Tensor:
    """Orthogonalize ``P`` in place, then ``Q = M^T P`` of every matrix followed by the
    uncompressed elements, in one fresh fp32 buffer."""
    qbuf = torch.empty(plan.q_numel + plan.dense_numel, dtype=torch.float32, device=xf.device)
    for g, m in zip(plan.groups, mats):
        p = orthogonalize_batched_(p_view(pbuf, g))
        torch.bmm(p.transpose(1, 2), m, out=q_view(qbuf, g))
    pos = plan.q_numel
    for o, n in plan.dense:
        qbuf[pos: pos + n].copy_(xf[o: o + n])
        pos += n
    return qbuf


def layer_decode_into(out: torch.Tensor, plan: LayerPlan, pbuf: torch.Tensor, qbuf: torch.Tensor,
                      scratch, dense_src=None) -> torch.Tensor:
    """``P Q^T`` of every matrix, and the uncompressed elements (from ``qbuf`` after its
    factors, or from ``dense_src``), into ``out`` (flat, contiguous); ``scratch(cols)`` gives
    :func:`outer_sum_into`'s scratch buffer.

    The aggregate must be bitwise equal on every rank, so the products are summed in a
    fixed order (:func:`outer_sum_into`), never by BLAS; this rank's own part (for error
    feedback) is decoded the same way, so that at world size 1 it equals the aggregate."""
    for g in plan.groups:
        p, q = p_view(pbuf, g), q_view(qbuf, g)
        rc = g.rows * g.cols
        buf = scratch(g.cols)
        for i, o in enumerate(g.offsets):  # straight into the output: no batch temp
            outer_sum_into(out[o: o + rc].view(g.rows, g.cols), p[i], q[i], buf)
    pos = plan.q_numel
    for o, n in plan.dense:
        out[o: o + n].copy_(dense_src[o: o + n] if dense_src is not None else qbuf[pos: pos + n])
        pos += n
    return out


def layer_decode(plan: LayerPlan, pbuf: torch.Tensor, qbuf: torch.Tensor, ctx, pool: PayloadPool,
                 ws: Workspace, dense_src=None, out=None) -> torch.Tensor:
    """:func:`layer_decode_into` a fresh flat tensor of ``ctx.dtype`` from ``pool`` (or into
    ``out``, flat and contiguous, of ``ctx.dtype``), with the outer-product scratch from ``ws``."""
    if out is None:  # reused memory once unreferenced (a fresh one page-faults: twice a step)
        out = pool.empty(ctx.numel, ctx.dtype, pbuf.device)
    return layer_decode_into(out, plan, pbuf, qbuf, lambda cols: outer_scratch(ws, cols, pbuf.device),
                             dense_src)


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


class MaterializedDecode(Deferred):
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

    def __init__(self, c: "PowerSGD", rnd: "PowerRound", qbuf: torch.Tensor, own: bool):
        self.c, self.rnd, self.qbuf, self.own = c, rnd, qbuf, own

    def _dense_src(self):
        return self.rnd.x.reshape(-1) if self.own else None

    def _decode(self, out=None) -> torch.Tensor:
        c, rnd = self.c, self.rnd
        return layer_decode(rnd.plan, rnd.p, self.qbuf, rnd.ctx, c.payload_pool(), c.workspace(),
                            self._dense_src(), out)

    def materialize(self) -> torch.Tensor:
        return self._decode()

    def into_(self, out: torch.Tensor) -> torch.Tensor:
        flat = out.view(-1) if out.is_contiguous() else None
        if flat is None or out.dtype != torch.float32 or flat.numel() != self.rnd.ctx.numel:
            return out.copy_(self.materialize())
        self._decode(flat)
        return out

    def residual_(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        ck = cpu_kernels.lib(x, r, self.rnd.p, self.qbuf)
        if (ck is None or x.dtype != torch.float32 or r.dtype != torch.float32
                or not (x.is_contiguous() and r.is_contiguous())):
            return super().residual_(x, r)
        plan, xf, rf = self.rnd.plan, x.view(-1), r.view(-1)
        nth = cpu_kernels.threads()
        for g in plan.groups:
            p, q = p_view(self.rnd.p, g), q_view(self.qbuf, g)
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
            p, qo, qs = p_view(self.rnd.p, g), q_view(own.qbuf, g), q_view(self.qbuf, g)
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
