"""Every compressor: round trips keep shape/dtype, lossless settings are exact, payload bytes
match wire_bytes, decompress_into/decompress_add_ agree with decompress, specs round trip,
and compressors stay usable after copying, pickling and use from several threads."""

import copy
import pickle
import threading

import pytest
import torch

import compressors
from compressors import (BF16, FP16, QSGD, REGISTRY, Context, Identity, RandomK, ScaledSign,
                         TopK, from_spec)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 2, 7, 2047, 2049, 10_001]


def instances():
    """Every registered compressor's ``examples()`` and ``edge_examples()``: a compressor
    that registers itself is tested here without editing this file."""
    return compressors.registry.examples(edge=True)


IDS = [repr(c) for c in instances()]


def _x(n, dtype, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed + n)).to(dtype)


@pytest.mark.parametrize("c", instances(), ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_shape_dtype_and_bytes(c, dtype):
    for n in SIZES:
        x = _x(n, dtype)
        ctx = Context.of(x, step=1, bucket=4, rank=1)
        payload = c.compress(x, ctx)
        nbytes = sum(p.numel() * p.element_size() for p in payload)
        assert nbytes == c.wire_bytes(n, dtype), (n, [p.shape for p in payload])
        dec = c.decompress(payload, ctx)
        assert dec.shape == (n,) and dec.dtype == dtype and dec.device == x.device
        if n:
            err = (dec.float() - x.float()).abs()
            assert bool((err <= c.error_bound(x).float()).all())
        # decompress_into (same dtype and fp32) and decompress_add_ give decompress's bits
        for out_dtype in {dtype, torch.float32}:
            out = torch.full((n,), 3.0, dtype=out_dtype)
            assert c.decompress_into(payload, ctx, out) is out
            assert torch.equal(out, dec.to(out_dtype))
        acc = _x(n, torch.float32, seed=5)
        want = acc + dec
        assert torch.equal(c.decompress_add_(payload, ctx, acc), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", [Identity(), TopK(1.0), TopK(1.0, exact=False), RandomK(1.0)],
                         ids=repr)
def test_lossless_settings_exact(c, dtype):
    for n in SIZES:
        x = _x(n, dtype, seed=1)
        ctx = Context.of(x)
        assert torch.equal(c.decompress(c.compress(x, ctx), ctx), x)


def test_casts_exact_for_representable_values():
    x = torch.randn(10_000).half().float()
    assert torch.equal(FP16().decompress(FP16().compress(x, Context.of(x)), Context.of(x)), x)
    x = torch.randn(10_000).bfloat16().float()
    assert torch.equal(BF16().decompress(BF16().compress(x, Context.of(x)), Context.of(x)), x)
    y = torch.tensor([1.0 + 2 ** -12])  # not representable in fp16: rounds to nearest even
    assert float(FP16().decompress(FP16().compress(y, Context.of(y)), Context.of(y))) == 1.0


def test_flags():
    assert Identity.lossless and not any(type(c).lossless for c in instances() if type(c) is not Identity)
    assert QSGD.unbiased and not TopK.unbiased and not ScaledSign.unbiased
    assert "allreduce" in RandomK.families and "allreduce" not in TopK.families


def _registered():
    seen, out = set(), []
    for name in sorted(REGISTRY):
        cls = REGISTRY[name]
        if cls not in seen:
            seen.add(cls)
            out.append(cls)
    return out


@pytest.mark.parametrize("cls", _registered(), ids=lambda c: c.__name__)
def test_spec_round_trip_every_registered(cls):
    c = cls()
    again = from_spec(c.spec())
    assert again == c and type(again) is cls and again.spec() == c.spec()
    assert hash(again) == hash(c)


@pytest.mark.parametrize("c", instances() + [QSGD(2, chunk=300), TopK(0.125, exact=False,
                                                                     sample=0.5)], ids=repr)
def test_spec_round_trip_configs(c):
    assert from_spec(c.spec()) == c
    assert compressors.get(c.name, **c.config()) == c


def test_spec_examples():
    assert from_spec("topk:density=0.01,exact=false") == TopK(0.01, exact=False)
    assert from_spec(" QSGD : bits=4 , chunk=256 ") == QSGD(4, 256)
    assert from_spec("half") == FP16() and from_spec("none") == Identity()
    assert QSGD(4, 256).spec() == "qsgd:bits=4,chunk=256"


@pytest.mark.parametrize("c", [QSGD(4, 64), ScaledSign(64), TopK(0.01, exact=False)], ids=repr)
def test_copy_pickle_and_threads(c):
    x = _x(300_000, torch.float32, seed=3)
    xs = [x * (i + 1) for i in range(4)]
    ctxs = [Context.of(v, step=i, rank=i) for i, v in enumerate(xs)]
    want = [c.compress(v, ctx) for v, ctx in zip(xs, ctxs)]
    for other in (copy.deepcopy(c), pickle.loads(pickle.dumps(c)), copy.copy(c)):
        assert other == c
        got = other.compress(xs[0], ctxs[0])
        assert all(torch.equal(a, b) for a, b in zip(got, want[0]))
    # per-thread workspaces: concurrent calls on one instance do not mix buffers
    errors = []

    def work(i):
        try:
            for _ in range(5):
                got = c.compress(xs[i], ctxs[i])
                if not all(torch.equal(a, b) for a, b in zip(got, want[i])):
                    errors.append(i)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("c", [QSGD(8), ScaledSign(), FP16(), TopK(0.5), RandomK(0.5)], ids=repr)
def test_large_payloads_and_outputs_are_fresh(c):
    """Payloads/outputs >= 2 MB come from their own huge-page mmaps: nothing aliases them, a
    later call does not overwrite them, they outlive the compressor and pickle fine."""
    n = 3_000_000
    x1, x2 = _x(n, torch.float32, seed=1), _x(n, torch.float32, seed=2)
    ctx = Context.of(x1)
    p1 = c.compress(x1, ctx)
    d1 = c.decompress(p1, ctx)
    keep = [t.clone() for t in p1], d1.clone()
    p2 = c.compress(x2, ctx)
    d2 = c.decompress(p2, ctx)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(p1, p2) if a.numel())
    assert d1.data_ptr() != d2.data_ptr()
    del c
    assert all(torch.equal(a, b) for a, b in zip(p1, keep[0])) and torch.equal(d1, keep[1])
    d1.add_(1.0)  # writable
    assert all(torch.equal(a, b) for a, b in zip(pickle.loads(pickle.dumps(p1)), p1))


def test_decompress_into_odd_outputs():
    q = QSGD(4, 100)
    x = _x(1000, torch.float32)
    ctx = Context.of(x)
    p = q.compress(x, ctx)
    want = q.decompress(p, ctx)
    big = torch.zeros(2000)
    strided = big[::2]  # not contiguous: falls back to copy_(decompress(...))
    q.decompress_into(p, ctx, strided)
    assert torch.equal(strided, want) and not big[1::2].any()
    shaped = torch.empty(10, 100)
    assert torch.equal(q.decompress_into(p, ctx, shaped).view(-1), want)
    with pytest.raises(RuntimeError):
        q.decompress_into(p, ctx, torch.empty(999))


@pytest.mark.parametrize("c", instances(), ids=IDS)
def test_inputs_that_require_grad(c):
    x = _x(5000, torch.float32, seed=4)
    xg = x.clone().requires_grad_(True)
    ctx = Context.of(x)
    want = c.decompress(c.compress(x, ctx), ctx)
    assert torch.equal(c.decompress(c.compress(xg, ctx), ctx).detach(), want)
