"""compressors.reproducible: fixed-order arithmetic for after a collective.

Exact where the math is exact: each function is compared bitwise with a scalar reference
that performs the same IEEE operations one at a time (numpy float32 scalars), and its result
must not depend on the thread count or on the memory offset (alignment) of its inputs.
"""

import numpy as np
import pytest
import torch

from compressors.reproducible import OUTER_BLOCK_ELEMS, outer_sum_into, tree_dot, tree_norm, tree_sum


def _ref_tree_sum(v):
    v = [np.float32(x) for x in v]
    if not v:
        return np.float32(0)
    while len(v) > 1:
        h = len(v) // 2
        nxt = [np.float32(v[i] + v[h + i]) for i in range(h)]
        if len(v) % 2:
            nxt.append(v[-1])
        v = nxt
    return v[0]


def _shifted(t, shift):
    """``t``'s values at element offset ``shift`` of a fresh buffer (another alignment)."""
    buf = torch.empty(t.numel() + shift, dtype=t.dtype)
    out = buf[shift:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 31, 100, 1025])
def test_tree_sum_matches_scalar_reference(n):
    g = torch.Generator().manual_seed(n)
    t = torch.randn(3, n, generator=g) * torch.logspace(-3, 3, max(n, 1))[:n]
    got = tree_sum(t)
    assert got.shape == (3, 1)
    for i in range(3):
        ref = _ref_tree_sum(t[i].numpy())
        assert got[i, 0].numpy().view(np.int32) == np.float32(ref).view(np.int32)


def test_tree_ops_ignore_threads_and_alignment():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 70001, generator=g), torch.randn(4, 70001, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (tree_dot(a, b), tree_norm(a))
        torch.set_num_threads(2)
        two = (tree_dot(a, b), tree_norm(a))
        shifted = [(tree_dot(_shifted(a, s), _shifted(b, s)), tree_norm(_shifted(a, s))) for s in (1, 3, 5)]
    finally:
        torch.set_num_threads(before)
    for other in [two] + shifted:
        assert torch.equal(one[0], other[0]) and torch.equal(one[1], other[1])
    assert torch.allclose(one[0].squeeze(1), (a.double() * b.double()).sum(1).float(), rtol=1e-4)
    assert torch.equal(tree_norm(a), tree_dot(a, a).sqrt())


def _ref_outer(p, q):
    rows, r = p.shape
    out = np.empty((rows, q.shape[1]), np.float32)
    pn, qn = p.numpy(), q.numpy()
    for i in range(rows):
        acc = (pn[i, 0] * qn[0]).astype(np.float32)
        for j in range(1, r):
            acc = (acc + (pn[i, j] * qn[j]).astype(np.float32)).astype(np.float32)
        out[i] = acc
    return torch.from_numpy(out)


@pytest.mark.parametrize("rows, cols, r", [(5, 384, 2), (384, 5, 4), (2, 9, 1), (3, 3, 4),
                                           (300, OUTER_BLOCK_ELEMS // 100 + 7, 3), (1, 1, 1)])
def test_outer_sum_into_is_ordered_products(rows, cols, r):
    g = torch.Generator().manual_seed(rows * cols + r)
    p, q = torch.randn(rows, r, generator=g), torch.randn(r, cols, generator=g)
    ref = _ref_outer(p, q)
    dst = torch.full((rows, cols), float("nan"))
    outer_sum_into(dst, p, q)
    assert torch.equal(dst, ref)
    # a small scratch is grown, a reused one gives the same bits, an offset input too
    again = torch.empty(rows, cols)
    outer_sum_into(again, _shifted(p, 3), _shifted(q, 1), torch.empty(4))
    assert torch.equal(again, ref)
    # half-precision output: the fp32 sum rounded once
    half = torch.empty(rows, cols, dtype=torch.bfloat16)
    outer_sum_into(half, p, q)
    assert torch.equal(half, ref.to(torch.bfloat16))
    assert torch.allclose(dst, p @ q, rtol=1e-5, atol=1e-5)


def test_outer_sum_into_ignores_threads():
    g = torch.Generator().manual_seed(7)
    p, q = torch.randn(700, 4, generator=g), torch.randn(4, 900, generator=g)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(outer_sum_into(torch.empty(700, 900), p, q))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_outer_sum_into_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="do not match"):
        outer_sum_into(torch.empty(3, 4), torch.empty(3, 2), torch.empty(3, 4))
