"""TopK (exact and sampled-threshold) and RandomK (shared indices)."""

import pytest
import torch

from compressors import Context, RandomK, TopK
from compressors.hashrng import SHARED, stream_key
from compressors.randomk import shared_indices
from unit_reference import topk_compress, topk_exact_compress


def _distinct_magnitudes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    mag = torch.randperm(n, generator=g).float() + 1.0
    sign = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return mag * sign / n


def _kept(c, x, ctx):
    dec = c.decompress(c.compress(x, ctx), ctx)
    return set(torch.nonzero(dec).squeeze(1).tolist()), dec


@pytest.mark.parametrize("density", [0.001, 0.01, 0.3])
@pytest.mark.parametrize("n", [1, 10, 1000, 100_003])
def test_exact_topk_keeps_the_k_largest(density, n):
    c = TopK(density, exact=True)
    x = _distinct_magnitudes(n, seed=n)
    ctx = Context.of(x)
    k = c.k_for(n)
    kept, dec = _kept(c, x, ctx)
    want = set(torch.topk(x.abs(), k).indices.tolist())
    assert len(want) == k and kept == want
    idx = torch.tensor(sorted(want), dtype=torch.long)
    assert torch.equal(dec[idx], x[idx])


@pytest.mark.parametrize("step", range(6))
def test_approx_topk_density_and_kept_set(step):
    n = 1_000_000
    c = TopK(0.01, exact=False)
    x = torch.randn(n, generator=torch.Generator().manual_seed(step))
    ctx = Context.of(x, step=step, rank=1)
    k = c.k_for(n)
    kept, dec = _kept(c, x, ctx)
    assert 0.8 * k <= len(kept) <= 1.2 * k
    exact = set(torch.topk(x.abs(), k).indices.tolist())
    if len(kept) >= k:
        assert kept == exact
    else:  # the sampled threshold was high: what is kept is still the largest there are
        assert kept <= exact
    idx = torch.tensor(sorted(kept), dtype=torch.long)
    assert torch.equal(dec[idx], x[idx])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("n,density,block", [(200_003, 0.01, 1024), (70_000, 0.001, None),
                                             (5, 0.01, None), (1000, 0.2, None)])
def test_topk_matches_reference(dtype, exact, n, density, block):
    c = TopK(density, exact=exact, sample=0.02)
    c.block = block
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    for step in (0, 1):
        ctx = Context.of(x, step=step, bucket=3, rank=2, seed=4)
        got = c.compress(x, ctx)
        if exact:  # the exact contract: ascending indices, ties toward the lowest index
            want = topk_exact_compress(x, density)
        else:
            want = topk_compress(x, density, exact, 0.02, step, 3, 2, 4)
        assert got[0].dtype == dtype and got[1].dtype == torch.int32
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_topk_pads_when_threshold_too_high():
    """Fewer candidates than k: slots padded with (index 0, value 0), decoding to nothing."""
    x = torch.zeros(100_000)
    x[:50] = torch.arange(1, 51, dtype=torch.float32)
    c = TopK(0.01, exact=False)
    ctx = Context.of(x)
    vals, idx = c.compress(x, ctx)
    assert vals.numel() == idx.numel() == c.k_for(x.numel())
    dec = c.decompress([vals, idx], ctx)
    assert torch.equal(dec, x)


@pytest.mark.parametrize("n,density", [(1, 0.5), (100, 0.01), (10_000, 0.05), (123_457, 0.3)])
def test_randomk_indices_distinct_in_range(n, density):
    c = RandomK(density, seed=3)
    ctx = Context(numel=n, step=5, bucket=2, rank=0, seed=9)
    idx = c.indices(ctx)
    k = c.k_for(n)
    assert idx.numel() == k
    assert int(idx.min()) >= 0 and int(idx.max()) < n
    assert torch.unique(idx).numel() == k


def test_randomk_indices_shared_across_ranks_and_vary_by_step():
    n = 50_000
    idx = lambda **kw: RandomK(0.01, seed=3).indices(Context(numel=n, seed=9, **kw)).clone()
    base = idx(step=5, bucket=2, rank=0)
    for rank in (1, 7, SHARED):
        assert torch.equal(idx(step=5, bucket=2, rank=rank), base)
    for other in (idx(step=6, bucket=2, rank=0), idx(step=5, bucket=3, rank=0)):
        assert not torch.equal(other, base)
        # a different sample, not a permutation of the same set
        assert len(set(other.tolist()) & set(base.tolist())) < base.numel() // 2
    assert not torch.equal(RandomK(0.01, seed=4).indices(Context(numel=n, step=5, bucket=2, seed=9)),
                           base)


def test_randomk_density_one_is_a_permutation_and_lossless():
    n = 3001
    c = RandomK(1.0)
    ctx = Context(numel=n, step=2)
    assert torch.equal(torch.sort(c.indices(ctx)).values, torch.arange(n))
    x = torch.randn(n)
    assert torch.equal(c.decompress(c.compress(x, ctx), ctx), x)


def test_shared_indices_cycle_walk_any_size():
    for n in (2, 3, 5, 1000, 1025, 65537):
        key = stream_key(1, 2, 3, SHARED)
        idx = shared_indices(n, n, key)
        assert torch.equal(torch.sort(idx).values, torch.arange(n))
