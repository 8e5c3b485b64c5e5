"""QSGD: the blocked fast path is bit-identical to the whole-tensor reference; unbiased;
every draw within error_bound."""

import math

import numpy as np
import pytest
import torch

import compressors.hashrng as H
from compressors import QSGD, Context
from compressors.qsgd import chunk_absmax
from unit_reference import qsgd_compress, qsgd_decompress

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _data(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    if n > 10:
        x[3], x[5] = 0.0, -0.0
    return x.to(dtype)


def _check_same(q, x, ctx):
    want = qsgd_compress(x, q.bits, q.chunk, ctx.step, ctx.bucket, ctx.rank, ctx.seed)
    got = q.compress(x, ctx)
    assert [t.dtype for t in got] == [torch.float32, torch.uint8]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    n = x.numel()
    dec = q.decompress(got, ctx)
    ref = qsgd_decompress(want, q.bits, q.chunk, n, x.dtype)
    assert dec.dtype == x.dtype and dec.shape == (n,)
    assert torch.equal(dec, ref)
    out = torch.full((n,), 7.0)
    assert q.decompress_into(got, ctx, out) is out and torch.equal(out, ref.float())
    acc = _data(n, torch.float32, seed=99)
    want_acc = acc + ref
    assert torch.equal(q.decompress_add_(got, ctx, acc), want_acc)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("chunk,block", [(2048, None), (7, 64), (100, 1024), (3000, 1024),
                                         (64, 64), (1 << 20, None)])
@pytest.mark.parametrize("n", [0, 1, 9, 4097, 70_003])
def test_fast_path_bit_identical(bits, chunk, block, n):
    if block == 64 and n > 5000:
        n = 1000 + n % 5000  # many tiny blocks cost time, not coverage
    q = QSGD(bits, chunk)
    q.block = block
    x = _data(n, torch.float32, seed=n + bits)
    _check_same(q, x, Context.of(x, step=3, bucket=2, rank=1, seed=5))


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_fast_path_bit_identical_half_inputs(dtype, bits):
    q = QSGD(bits, 100)
    q.block = 1024
    x = _data(5003, dtype, seed=bits)
    _check_same(q, x, Context.of(x, step=1))


@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy", "torch"])
def test_torch_only_path_bit_identical(monkeypatch, use_numpy):
    """The pure-torch ops (what CUDA runs) give the same bits as the numpy-assisted CPU path;
    one block larger than 2**16 (folded keys per span) and blocks of an odd multiple."""
    monkeypatch.setattr(H, "USE_NUMPY_ON_CPU", use_numpy)
    import compressors.qsgd_blocks as QB
    monkeypatch.setattr(QB, "_NP_CAST_OK", use_numpy)
    for block in (1 << 17, 1 << 22):
        q = QSGD(8)
        q.block = block
        x = _data(300_001, torch.float32, seed=block)
        _check_same(q, x, Context.of(x, step=7, rank=3))


def test_nonfinite_and_tiny_inputs_match_reference():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    x[5] = float("nan")
    x[3000] = float("inf")
    x[5000:5100] = 1e-40  # a chunk whose scale overflows r = M/2 / s to inf
    x[7000] = -float("inf")
    x[9000:] = 0
    for bits in (1, 2, 4, 8):
        q = QSGD(bits, 1000)
        q.block = 2048
        ctx = Context.of(x)
        got = q.compress(x, ctx)
        want = qsgd_compress(x, bits, 1000)
        assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
        assert torch.equal(got[1], want[1])
        dec = q.decompress(got, ctx).view(torch.int32)
        assert torch.equal(dec, qsgd_decompress(want, bits, 1000, x.numel()).view(torch.int32))


def test_chunk_absmax_exact():
    x = _data(10_007, torch.float32)
    x[17] = -1e30
    s = chunk_absmax(x, 1000)
    want = torch.stack([x[i:i + 1000].abs().max() for i in range(0, 10_007, 1000)])
    assert torch.equal(s, want) and s[0] == 1e30
    assert torch.equal(chunk_absmax(-torch.zeros(5), 2), torch.zeros(3))
    assert not torch.signbit(chunk_absmax(-torch.zeros(5), 2)).any()


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unbiased_and_within_error_bound(bits):
    """E[decoded] = x: the mean over D draws (the step changes the hash stream) approaches x
    like 1/sqrt(D); each single draw stays within error_bound."""
    n, chunk = 4096, 512
    q = QSGD(bits, chunk)
    x = _data(n, torch.float32, seed=bits)
    bound = q.error_bound(x)
    M = (1 << bits) - 1
    s = chunk_absmax(x, chunk).repeat_interleave(chunk)
    w = (2 * s / M).double()
    # the fractional part of t = x * r + M/2 decides the rounding variance w^2 f (1 - f)
    r = torch.where(s > 0, torch.tensor(M * 0.5) / s, torch.zeros_like(s))
    t = (x * r).add_(M * 0.5).double()
    f = t - t.floor()
    sd1 = w * (f * (1 - f)).sqrt()  # std of one draw, per element
    total = torch.zeros(n, dtype=torch.float64)
    rms = {}
    for d in range(1, 401):
        dec = q.decompress(q.compress(x, Context.of(x, step=d, rank=2)), Context.of(x))
        err = (dec - x).abs()
        assert bool((err <= bound).all()), float((err - bound).max())
        total += dec.double()
        if d in (25, 400):
            rms[d] = float(((total / d - x.double()) ** 2).mean().sqrt())
            mean_err = total / d - x.double()
            # per element within 6 sigma (4096 elements), plus a Bernstein-style 6 w / d for
            # rarely-rounded elements (f near 0 or 1: a binomial, not yet a normal) and fp slack
            tol = 6 * sd1 / math.sqrt(d) + 6 * w / d + 1e-6 * w + 1e-7
            assert bool((mean_err.abs() <= tol).all())
            # the mean error over all elements: 4 sigma
            sd_all = float((sd1 ** 2).sum().sqrt()) / n / math.sqrt(d)
            assert abs(float(mean_err.mean())) <= 4 * sd_all + 1e-7
    # error of the mean shrinks like 1/sqrt(draws): 16x the draws -> ~4x smaller
    assert 2.5 < rms[25] / rms[400] < 6.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [1, 8])
def test_error_bound_holds_for_all_dtypes(dtype, bits):
    q = QSGD(bits, 256)
    x = _data(20_000, dtype, seed=3)
    b = q.error_bound(x)
    assert b.dtype == dtype and b.shape == x.shape
    for step in range(5):
        dec = q.decompress(q.compress(x, Context.of(x, step=step)), Context.of(x))
        assert bool(((dec.float() - x.float()).abs() <= b.float()).all())


def test_streams_differ_by_rank_and_step():
    q = QSGD(2, 256)
    x = _data(4096, torch.float32)
    p = lambda **kw: q.compress(x, Context.of(x, **kw))[1]
    assert torch.equal(p(step=1, rank=0), p(step=1, rank=0))
    assert not torch.equal(p(step=1, rank=0), p(step=1, rank=1))
    assert not torch.equal(p(step=1, rank=0), p(step=2, rank=0))


def test_payload_not_aliased_by_later_calls():
    """Payloads are fresh: a later call (same instance, same size) must not overwrite them."""
    q = QSGD(4, 128)
    q.block = 1024
    x1, x2 = _data(5000, torch.float32, 1), _data(5000, torch.float32, 2)
    p1 = q.compress(x1, Context.of(x1))
    keep = [t.clone() for t in p1]
    q.compress(x2, Context.of(x2))
    q.decompress(p1, Context.of(x1))
    assert all(torch.equal(a, b) for a, b in zip(p1, keep))


def test_zero_input_decodes_to_zero():
    for bits in (1, 2, 4, 8):
        q = QSGD(bits)
        x = torch.zeros(3000)
        dec = q.decompress(q.compress(x, Context.of(x)), Context.of(x))
        assert torch.equal(dec, x)
        assert np.all(np.signbit(dec.numpy()) == False)  # noqa: E712 (no -0.0)
