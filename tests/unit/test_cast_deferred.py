"""The casts (fp16, bf16) on the allreduce with deferred results: the residual ``x -
widen(narrow(x))`` and the widened aggregate, written by the hook in one compiled pass
(``cp_cast_finish``), have the bits of decoding the payloads (the torch path), for every
thread count, non-finite and boundary input, with the kernels and without them."""

import pytest
import torch

from comms.algorithms.base import Want
from comms.algorithms import ALGORITHMS
from compressors import Context, cpu_kernels, from_spec
from compressors.deferred import Deferred
from compressors.cast import CastOwn, CastSum

WIRES = [("fp16", torch.float16), ("bf16", torch.bfloat16)]


class OtherRankComm:
    """A two-rank allreduce as one process sees it: adds another rank's payload in place."""

    rank, world_size, backend = 0, 2, "local"

    def __init__(self, other: torch.Tensor):
        self.other = other
        self.calls = []

    def all_reduce(self, t):
        self.calls.append((t.numel(), t.dtype))
        t.add_(self.other.to(t.dtype))
        f = torch.futures.Future()
        f.set_result(t)
        return f


def bucket(n: int, seed: int) -> torch.Tensor:
    """Values across fp16's whole range and beyond, with -0, its overflow boundary (65504 stays,
    65520 rounds to inf), subnormals of both wire dtypes, inf and NaN of both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 6)
    for k, v in enumerate([-0.0, 65504.0, 65520.0, 65519.99, -65536.0, 1e-41, 5.96e-8, 2.98e-8,
                           3e-5, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 1.0 + 2 ** -8]):
        x[k::97 + k] = v
    x[1], x[2], x[3], x[4] = float("inf"), float("nan"), -float("inf"), -float("nan")
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN positions equal (NaN payloads may differ: hardware and software
    narrowing quiet them differently; a NaN bucket is flagged and reset anyway)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("spec,wire", WIRES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [5, 7, 200_003])  # < 8: the scalar loop only
def test_cast_finish_kernel_equals_torch(spec, wire, threads, n, monkeypatch):
    c = cpu_kernels.lib()
    if c is None:
        pytest.skip(f"no compiled kernels here: {cpu_kernels.build_error()}")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    x = bucket(n, seed=n + threads)
    summed = bucket(n, seed=7).to(wire)
    want_r = torch.sub(x, x.to(wire).to(torch.float32))
    want_x = summed.to(torch.float32)
    code = {torch.float16: 1, torch.bfloat16: 2}[wire]
    xx, r = x.clone(), torch.full_like(x, 7.0)
    c.cp_cast_finish(xx.data_ptr(), r.data_ptr(), summed.data_ptr(), code, n, threads)
    assert same_bits(r, want_r) and same_bits(xx, want_x)
    xx, r = x.clone(), torch.full_like(x, 7.0)
    c.cp_cast_finish(xx.data_ptr(), r.data_ptr(), None, code, n, threads)  # residual only
    assert same_bits(r, want_r) and torch.equal(xx.view(torch.int32), x.view(torch.int32))
    c.cp_cast_finish(xx.data_ptr(), None, summed.data_ptr(), code, n, threads)  # aggregate only
    assert same_bits(xx, want_x)
    # the narrowing itself: the residual is 0 exactly where x is representable in the wire dtype
    fin = torch.isfinite(x) & torch.isfinite(x.to(wire))
    assert torch.equal(r[fin] == 0, x[fin].to(wire).to(torch.float32) == x[fin])


@pytest.mark.parametrize("spec,wire", WIRES)
@pytest.mark.parametrize("kernels", [True, False])
def test_allreduce_deferred_equals_decoded(spec, wire, kernels, monkeypatch):
    """``allreduce(..., deferred=True)`` of a cast: ``own``/``sum`` come back as
    :class:`CastOwn`/:class:`CastSum` and give the bits of the decoded results of the
    ``deferred=False`` call — as the residual, into the bucket, and both in one pass."""
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "lib", lambda *a: None)
    comp = from_spec(spec)
    n = 100_003
    x = bucket(n, seed=3)
    other = (torch.randn(n, generator=torch.Generator().manual_seed(4)) * 3).to(wire)
    ctx = Context(numel=n, step=2, bucket=0)
    comm = OtherRankComm(other)
    total, own = ALGORITHMS["allreduce"](comm, comp, x.clone(), ctx, {}).wait()
    xd = x.clone()
    dtotal, down = ALGORITHMS["allreduce"](comm, comp, xd, ctx, {}, Want(deferred=True)).wait()
    assert comm.calls == [(n, wire)] * 2  # the payload is the wire: no copy, no extra round
    assert isinstance(down, CastOwn) and isinstance(dtotal, CastSum)
    assert same_bits(down.materialize(), own) and same_bits(dtotal.materialize(), total)
    r = torch.full((n,), 7.0)
    assert down.residual_(xd, r) is r and same_bits(r, torch.sub(x, own))
    out = torch.full((n,), 7.0)
    assert dtotal.into_(out) is out and same_bits(out, total)
    rr = torch.full((n,), 7.0)
    assert dtotal.into_with_residual_(down, xd, rr) is xd  # the hook's path (error feedback)
    assert same_bits(rr, torch.sub(x, own)) and same_bits(xd, total)
    assert not torch.equal(total, own)  # the other rank's payload is in the aggregate


def test_deferred_only_for_fp32_buckets():
    """An fp16 bucket sent as fp16 (its payload is the bucket itself) and a bf16 bucket decode
    now, as before: no Deferred, and the allreduce sums a copy, never the bucket."""
    comp = from_spec("fp16")
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(1000).to(dtype)
        ctx = Context(numel=1000, dtype=dtype)
        assert comp.deferred_own(x, comp.compress(x, ctx), ctx) is None
        comm = OtherRankComm(torch.ones(1000))
        total, own = ALGORITHMS["allreduce"](comm, comp, x.clone(), ctx, {}, Want(deferred=True)).wait()
        assert not isinstance(total, Deferred) and not isinstance(own, Deferred)
        assert torch.equal(own, x.to(torch.float16).to(dtype))


def test_residual_of_another_tensor_falls_back():
    """``residual_`` given a tensor other than the one compressed: the torch path, from the
    values that were compressed (what ``own`` means), never the kernel on the wrong memory."""
    comp = from_spec("fp16")
    x = bucket(1000, seed=5)
    ctx = Context(numel=1000)
    own = comp.deferred_own(x, comp.compress(x, ctx), ctx)
    y = x.clone()
    r = torch.empty(1000)
    own.residual_(y, r)
    assert same_bits(r, torch.sub(y, x.to(torch.float16).to(torch.float32)))
