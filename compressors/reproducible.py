"""Rank-reproducible arithmetic for what runs *after* a collective.

Every rank holds the same summed bits after an allreduce; whatever it computes from them and
returns as the gradient must give the same bits on every rank. Library reductions do not
promise that: a BLAS ``gemm`` (MKL, OpenBLAS, cuBLAS) may pick its kernel, blocking and
FMA use by pointer alignment, thread count, concurrent callers or CPU generation, and a
torch ``sum``/``norm``/``dot`` accumulates in an order that depends on the thread count and
the SIMD width the CPU dispatches to. Seen here: PowerSGD rank 2 rebuilt ``P Q^T`` with MKL
and two ranks differed by one ulp after 10 steps.

The functions below use only elementwise IEEE-754 operations (``mul``, ``add`` with
``alpha = 1``, ``sub``, ``div``, ``sqrt``) issued in a fixed program order, so their result
depends on the input bits alone: not on threads, SIMD width, alignment or library. Ops that
may fuse a multiply and an add into one rounding (``addcmul``, ``addmm``, ``lerp``, ``baddbmm``)
are avoided: whether they fuse differs between code paths and builds.

``add_`` with the default ``alpha = 1`` is safe even where the kernel is compiled to
``fma(alpha, b, a)``: ``fma(1, b, a)`` rounds ``a + b`` once, exactly like the plain add.
"""

from __future__ import annotations

import torch

__all__ = ["tree_sum", "tree_dot", "tree_norm", "outer_sum_into", "OUTER_BLOCK_ELEMS"]

# Elements of ``dst`` per block of the blocked outer-product sum: the running block and one
# term stay cache-resident. Chosen by measurement (6 x 2048 x 2048, r = 4, one thread): per-op
# dispatch dominates below ~64K elements, cache misses above ~1M.
OUTER_BLOCK_ELEMS = 1 << 17


def tree_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as a fixed pairwise tree of elementwise adds.

    Level by level, element ``i`` of the first half is added to element ``i`` of the second
    half; an odd last element is carried to the next level unchanged. The result has the
    last dim of size 1 (kept), the dtype of ``t``; an empty last dim sums to 0.
    """
    n = t.shape[-1]
    if n == 0:
        return t.new_zeros(t.shape[:-1] + (1,))
    while n > 1:
        h = n // 2
        s = t[..., :h] + t[..., h: 2 * h]
        if n % 2:
            s = torch.cat([s, t[..., 2 * h:]], dim=-1)
        t, n = s, s.shape[-1]
    return t


def tree_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(a * b)`` over the last dim (kept, size 1) with :func:`tree_sum`'s fixed order."""
    return tree_sum(a * b)


def tree_norm(a: torch.Tensor) -> torch.Tensor:
    """Euclidean norm over the last dim (kept, size 1): ``sqrt`` of :func:`tree_dot` ``(a, a)``.

    No scaling against overflow: entries beyond ~1e19 in fp32 square to inf.
    """
    return tree_dot(a, a).sqrt_()


def outer_sum_into(dst: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                   scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``dst = p @ q`` as ``sum_j p[:, j] (x) q[j, :]`` accumulated in order ``j = 0, 1, ...``.

    Args:
        dst: ``rows x cols`` output (written, any float dtype: each term is computed in the
            dtype of ``p``/``q`` and the sum rounded to ``dst.dtype`` once at the end when
            they differ).
        p: ``rows x r``; q: ``r x cols``, the same float dtype.
        scratch: an optional 1-D buffer of ``p``'s dtype (reused across calls to avoid page
            faults); grown internally when too small.

    Every element is ``((p0 q0 + p1 q1) + p2 q2) + ...`` with each product and each sum
    rounded separately: bitwise equal on every rank for equal inputs. Rank 1 is one
    elementwise multiply; higher ranks work in row blocks of about
    :data:`OUTER_BLOCK_ELEMS` elements so the running sum stays in cache.
    """
    rows, r = p.shape
    cols = q.shape[1]
    if q.shape[0] != r or tuple(dst.shape) != (rows, cols):
        raise ValueError(f"outer_sum_into: shapes dst {tuple(dst.shape)}, p {tuple(p.shape)}, "
                         f"q {tuple(q.shape)} do not match")
    direct = dst.dtype == p.dtype
    if r == 1 and direct:
        return torch.mul(p, q, out=dst)
    if rows == 0 or cols == 0:
        return dst
    br = max(1, min(rows, OUTER_BLOCK_ELEMS // max(cols, 1)))
    need = (br * cols) * (1 if direct else 2)
    if scratch is None or scratch.numel() < need or scratch.dtype != p.dtype:
        scratch = torch.empty(need, dtype=p.dtype, device=p.device)
    for r0 in range(0, rows, br):
        r1 = min(rows, r0 + br)
        n = (r1 - r0) * cols
        term = scratch[:n].view(r1 - r0, cols)
        acc = dst[r0:r1] if direct else scratch[br * cols: br * cols + n].view(r1 - r0, cols)
        pb = p[r0:r1]
        torch.mul(pb[:, 0:1], q[0:1], out=acc)
        for j in range(1, r):
            torch.mul(pb[:, j: j + 1], q[j: j + 1], out=term)
            acc.add_(term)
        if not direct:
            dst[r0:r1].copy_(acc)
    return dst
