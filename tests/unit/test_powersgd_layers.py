"""PowerSGD per layer (``Context.shapes`` known): plan, exactness on low-rank matrices,
batched vs one-by-one, two allreduces per bucket, wire bytes, fallbacks."""

import math

import pytest
import torch

import compressors
from comms.algorithms.base import Want
from comms.algorithms import ALGORITHMS
from compressors import Context
from compressors.powersgd import PowerSGD
from compressors.powersgd_layers import orthogonalize_, orthogonalize_batched_


class LocalComm:
    """A one-rank communicator that records every allreduce (the sum of one is itself)."""

    rank, world_size, backend = 0, 1, "local"

    def __init__(self):
        self.sizes = []

    def all_reduce(self, t):
        self.sizes.append((t.numel(), t.dtype))
        f = torch.futures.Future()
        f.set_result(t)
        return f


def low_rank_bucket(shapes, rank, seed=0, dtype=torch.float32):
    """Flat bucket: every >= 2-D tensor has rank <= ``rank``, 1-D ones are random."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for sh in shapes:
        if len(sh) >= 2:
            rows, cols = sh[0], math.prod(sh[1:])
            parts.append((torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)).reshape(-1))
        else:
            parts.append(torch.randn(sh, generator=g).reshape(-1))
    return torch.cat(parts).to(dtype)


# DDP order of an MLP (bias, weight per layer), a conv weight, repeated shapes, a tiny matrix
SHAPES = ((64,), (64, 48), (48,), (48, 48), (64, 48), (8, 3, 4, 4), (3, 2), (48, 48), ())


def test_context_shapes_default_and_known():
    x = torch.zeros(10)
    assert Context.of(x).shapes == () and Context.of(x).known_shapes() == ()
    assert Context.of(x, shapes=((2, 3), [4])).known_shapes() == ((2, 3), (4,))
    assert Context.of(x, shapes=((2, 3),)).known_shapes() == ()  # 6 != 10: unknown
    assert Context.of(x, shapes=((2, 3), (4,))).with_(numel=5).known_shapes() == ()  # a shard


def test_layer_plan_groups_and_dense():
    c = PowerSGD(rank=2)
    plan = c.layer_plan(SHAPES)
    offs = [0]
    for sh in SHAPES:
        offs.append(offs[-1] + math.prod(sh))
    groups = {(g.rows, g.cols): g for g in plan.groups}
    assert list(groups) == [(64, 48), (48, 48), (8, 48)]  # first appearance order
    assert groups[(64, 48)].offsets == (offs[1], offs[4])
    assert groups[(48, 48)].offsets == (offs[3], offs[7])
    assert groups[(64, 48)].spacing == offs[4] - offs[1]
    # 1-D tensors, the scalar and the 3x2 matrix (factors not 2x smaller) go uncompressed
    assert plan.dense == ((offs[0], 64), (offs[2], 48), (offs[6], 6), (offs[8], 1))
    assert plan.dense_numel == 64 + 48 + 6 + 1
    assert plan.p_numel == 2 * (2 * 64 + 2 * 48 + 8)
    assert plan.q_numel == 2 * (2 * 48 + 2 * 48 + 48)
    assert c.shaped_wire_bytes(SHAPES) == 4 * (plan.p_numel + plan.q_numel + plan.dense_numel)
    # nothing worth factorizing: dense in the bucket dtype
    assert c.layer_plan(((5,), (3, 2))) is None
    assert c.shaped_wire_bytes(((5,), (3, 2)), torch.float16) == 2 * 11


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_low_rank_layers_are_exact(rank):
    c = PowerSGD(rank=rank)
    x = low_rank_bucket(SHAPES, rank, seed=rank)
    ctx = Context.of(x, shapes=SHAPES)
    y = c.decompress(c.compress(x, ctx), ctx)
    plan = c.layer_plan(SHAPES)
    for o, n in plan.dense:  # uncompressed parts: bitwise
        assert torch.equal(y[o: o + n], x[o: o + n])
    assert float((y - x).norm() / x.norm()) < 1e-5
    # the flat view of the same bucket is not low rank: it loses most of it
    flat = Context.of(x)
    assert float((c.decompress(c.compress(x, flat), flat) - x).norm() / x.norm()) > 0.1


def test_batched_equals_one_by_one():
    """A group's batch (strided view) gives the bits of each matrix alone (stack path too)."""
    c = PowerSGD(rank=2)
    g = torch.Generator().manual_seed(3)
    shapes = ((32, 40), (7,), (32, 40), (7,), (32, 40))  # equally spaced: as_strided batch
    shapes_gap = ((32, 40), (32, 40), (7,), (32, 40))  # unequal gaps: stacked copy
    for shp in (shapes, shapes_gap):
        x = torch.randn(sum(math.prod(s) for s in shp), generator=g)
        ctx = Context.of(x, shapes=shp)
        grp = c.layer_plan(shp).groups[0]
        assert grp.spacing == (32 * 40 + 7 if shp is shapes else 0)
        p, q = c.compress(x, ctx)
        q0 = c._initial_q_layers(ctx, c.layer_plan(shp)).view(3, 2, 40)
        for i, o in enumerate(grp.offsets):
            m = x[o: o + 32 * 40].view(32, 40)
            pi = orthogonalize_batched_((m @ q0[i].t()).unsqueeze(0))[0]
            assert torch.allclose(p.view(3, 32, 2)[i], pi, atol=1e-5)
            assert torch.allclose(q[: 3 * 80].view(3, 2, 40)[i], pi.t() @ m, atol=1e-4)


def test_batched_orthogonalization_matches_single():
    g = torch.Generator().manual_seed(1)
    p = torch.randn(4, 30, 3, generator=g)
    single = torch.stack([orthogonalize_(p[i].clone()) for i in range(4)])
    out = orthogonalize_batched_(p.clone())
    assert torch.allclose(out, single, atol=1e-5)
    eye = torch.eye(3).expand(4, 3, 3)
    assert torch.allclose(out.transpose(1, 2) @ out, eye, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_allreduce_two_rounds_and_ef(dtype):
    c = PowerSGD(rank=2)
    x = low_rank_bucket(SHAPES, 3, seed=5, dtype=dtype)  # rank 3 > 2: lossy
    ctx = Context.of(x, shapes=SHAPES, seed=7)
    comm, store = LocalComm(), {}
    total, own = ALGORITHMS["allreduce"](comm, c, x, ctx, store).wait()
    plan = c.layer_plan(SHAPES)
    # exactly two fp32 rounds: all P's, then all Q's + the uncompressed elements
    assert comm.sizes == [(plan.p_numel, torch.float32),
                          (plan.q_numel + plan.dense_numel, torch.float32)]
    assert 4 * sum(n for n, _ in comm.sizes) == c.shaped_wire_bytes(SHAPES)
    assert total.dtype == own.dtype == dtype and total.shape == x.shape
    assert torch.equal(total, own)  # one rank: the aggregate is its own part
    for o, n in plan.dense:  # uncompressed parts carry no residual
        assert torch.equal(own[o: o + n], x[o: o + n])
    assert float((own.float() - x.float()).norm()) > 1e-3 * float(x.float().norm())  # lossy
    # warm start: the aggregated Q is kept, with the P's, as plain tensors
    assert store["powersgd_q"].numel() == plan.q_numel and store["powersgd_p"].numel() == plan.p_numel
    # the next step starts from that Q: a second call on the same data moves closer to x
    total2, _ = ALGORITHMS["allreduce"](comm, c, x, ctx, store).wait()
    assert float((total2.float() - x.float()).norm()) <= float((total.float() - x.float()).norm()) * 1.001


def test_nothing_to_factorize_is_one_dense_allreduce():
    c = PowerSGD(rank=1)
    shapes = ((100,), (3, 2))
    x = torch.randn(106)
    comm = LocalComm()
    total, own = ALGORITHMS["allreduce"](comm, c, x, Context.of(x, shapes=shapes), {}).wait()
    assert comm.sizes == [(106, torch.float32)]
    assert torch.equal(total, x) and torch.equal(own, x)


def test_unknown_or_mismatched_shapes_keep_the_flat_format():
    c = PowerSGD(rank=2)
    x = torch.randn(10100)
    flat = c.compress(x, Context.of(x))
    bad = c.compress(x, Context.of(x, shapes=((100, 100),)))  # 10000 != 10100: ignored
    assert [t.shape for t in flat] == [t.shape for t in bad] == [(100, 2), (101, 2)]  # P (rows x r), Q (cols x r)
    assert all(torch.equal(a, b) for a, b in zip(flat, bad))
    assert compressors.from_spec("powersgd:rank=2").wire_bytes(10100) == 4 * 2 * (100 + 101)


@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("kernels", [True, False])
def test_powersgd_deferred_decode(rank, kernels, monkeypatch):
    """``allreduce(..., deferred=True)``: the residual written by ``residual_`` and the sum
    written by ``into_`` have the bits of the materialized decodes (``x - own``, ``sum``),
    with the compiled pass and with the torch fallback; NaN/inf/-0 pass through as they do."""
    from compressors import cpu_kernels
    from compressors.deferred import Deferred

    if not kernels:
        monkeypatch.setattr(cpu_kernels, "lib", lambda *a: None)
    shapes = ((24, 40), (5,), (24, 40), (7, 3, 4), (9,), (16, 16))
    n = sum(math.prod(s) for s in shapes)
    x = low_rank_bucket(shapes, 5, seed=rank) + 0.01 * torch.randn(n, generator=torch.Generator().manual_seed(1))
    x[3], x[970], x[1001] = float("nan"), -0.0, float("inf")  # a NaN/inf matrix, a -0 in a 1-D part
    c = PowerSGD(rank=rank)
    ctx = Context(numel=n, shapes=shapes, step=2, bucket=1, seed=3)
    total, own = ALGORITHMS["allreduce"](LocalComm(), c, x.clone(), ctx, {}).wait()
    dtotal, down = ALGORITHMS["allreduce"](LocalComm(), c, x.clone(), ctx, {}, Want(deferred=True)).wait()
    assert isinstance(dtotal, Deferred) and isinstance(down, Deferred)
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    r = torch.full((n,), 7.0)
    down.residual_(x, r)
    assert torch.equal(bits(r), bits(torch.sub(x, own)))
    out = torch.full((n,), 7.0)
    dtotal.into_(out)
    assert torch.equal(bits(out), bits(total))
    assert torch.equal(bits(down.materialize()), bits(own))
    assert torch.equal(bits(dtotal.residual_(x, torch.empty(n))), bits(x - total))
    # the residual and the aggregate in one pass (the hook's path): an aggregate whose Q and
    # uncompressed elements differ from this rank's own, as they do at world size > 1
    from compressors.powersgd_layers import LayerDecode
    q_sum = dtotal.qbuf * 1.5 - 0.25
    agg = LayerDecode(c, dtotal.rnd, q_sum, False)
    mine = LayerDecode(c, dtotal.rnd, down.qbuf, True)
    xx, rr = x.clone(), torch.full((n,), 7.0)
    assert agg.into_with_residual_(mine, xx, rr) is xx
    want_r = torch.sub(x, mine.materialize())
    assert torch.equal(bits(rr), bits(want_r))
    assert torch.equal(bits(xx), bits(agg.materialize()))
    assert not torch.equal(bits(agg.materialize()), bits(mine.materialize()))
