"""ScaledSign: the blocked fast path is bit-identical to the whole-tensor reference."""

import pytest
import torch

from compressors import Context, ScaledSign
from unit_reference import sign_compress, sign_decompress


def _data(n, dtype, seed=0):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    if n > 10:
        x[3], x[5] = 0.0, -0.0
    return x.to(dtype)


def _check_same(c, x):
    ctx = Context.of(x)
    want = sign_compress(x, c.chunk)
    got = c.compress(x, ctx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    n = x.numel()
    ref = sign_decompress(want, c.chunk, n, x.dtype)
    dec = c.decompress(got, ctx)
    assert dec.dtype == x.dtype and torch.equal(dec, ref)
    out = torch.empty(n)
    assert torch.equal(c.decompress_into(got, ctx, out), ref.float())
    acc = torch.randn(n, generator=torch.Generator().manual_seed(7))
    want_acc = acc + ref
    assert torch.equal(c.decompress_add_(got, ctx, acc), want_acc)


@pytest.mark.parametrize("chunk,block", [(2048, None), (7, 1024), (64, 8), (3000, 1024),
                                         (32768, None), (40_000, 1 << 16), (1 << 16, 1 << 16),
                                         (100_000, None)])
@pytest.mark.parametrize("n", [0, 1, 9, 4097, 2 * 32768 + 5, 3 * 40_000, (1 << 17) + 3])
def test_fast_path_bit_identical(chunk, block, n):
    if block == 8 and n > 5000:
        n = 1000 + n % 5000
    c = ScaledSign(chunk)
    c.block = block
    _check_same(c, _data(n, torch.float32, seed=n))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_path_bit_identical_half_inputs(dtype):
    c = ScaledSign(100)
    c.block = 1024
    _check_same(c, _data(5003, dtype))


def test_fast_path_bit_identical_one_thread():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for chunk in (2048, 40_000):
            _check_same(ScaledSign(chunk), _data(200_003, torch.float32, seed=chunk))
    finally:
        torch.set_num_threads(threads)


def test_values_and_error_bound():
    c = ScaledSign(4)
    x = torch.tensor([1.0, -2.0, 3.0, -0.0, 0.5, 0.5, -1.0])
    dec = c.decompress(c.compress(x, Context.of(x)), Context.of(x))
    # chunk means 1.5 and 2/3; bit 1 for x >= 0 (-0.0 included)
    m2 = torch.tensor([0.5, 0.5, 1.0]).mean()
    assert torch.equal(dec, torch.stack([torch.tensor(1.5), torch.tensor(-1.5), torch.tensor(1.5),
                                         torch.tensor(1.5), m2, m2, -m2]))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = _data(10_000, dtype)
        dec = c.decompress(c.compress(x, Context.of(x)), Context.of(x))
        assert bool(((dec.float() - x.float()).abs() <= c.error_bound(x).float()).all())
