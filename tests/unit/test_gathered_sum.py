"""``allgather(..., deferred=True)``: the sum comes back as a :class:`GatheredSum` that the
hook decodes straight into the bucket — the bits of the sum into zeros and its copy, for every
compressor of the gather family, with -0, inf and NaN in the input."""

import pytest
import torch

from comms.algorithms.base import Want
from comms.algorithms import ALGORITHMS
from comms.algorithms.allgather import GatheredSum
from compressors import Context, from_spec
from compressors.deferred import Deferred, materialized

SPECS = ["topk:density=0.01", "topk:density=0.05,exact=false", "randomk:density=0.02", "sign",
         "qsgd:bits=4", "qsgd:bits=8", "fp16"]


class TwoRankGather:
    """A two-rank allgather as rank 0 sees it: its own bytes, then another rank's."""

    rank, world_size, backend = 0, 2, "local"

    def __init__(self, other_bytes):
        self.other_bytes = other_bytes

    def all_gather(self, t):
        other = self.other_bytes(t)
        f = torch.futures.Future()
        f.set_result(torch.cat([t, other]))
        return f


def payload_bytes(comp, y, ctx):
    from comms.algorithms.wire import to_bytes
    return to_bytes(comp.compress(y, ctx))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gathered_sum_into_bucket_equals_the_copy(spec, dtype):
    comp = from_spec(spec)
    if not comp.fixed_size:
        pytest.skip("variable-size payloads exchange their sizes first (another round)")
    n = 50_021
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    x[::101] = -0.0
    y = (torch.randn(n, generator=g) * 2).to(dtype)
    ctx = Context(numel=n, dtype=dtype, step=3, bucket=1, seed=2)
    comm = TwoRankGather(lambda t: payload_bytes(comp, y, ctx.with_(rank=1)))
    total, own = ALGORITHMS["allgather"](comm, comp, x.clone(), ctx, {}).wait()
    dtotal, down = ALGORITHMS["allgather"](comm, comp, x.clone(), ctx, {}, Want(deferred=True)).wait()
    assert isinstance(dtotal, GatheredSum) and not isinstance(total, GatheredSum)
    assert torch.equal(materialized(down), own)
    out = torch.full((n,), 7.0, dtype=dtype)
    assert dtotal.into_(out) is out
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), total.view(bits))
    assert torch.equal(dtotal.materialize().view(bits), total.view(bits))
    assert not torch.equal(total, own)  # the other rank's payload is in it


def test_gathered_sum_non_finite():
    comp = from_spec("sign")
    n = 4096
    x = torch.randn(n)
    x[5], x[700], x[2000] = float("inf"), float("nan"), -0.0
    ctx = Context(numel=n, step=1)
    comm = TwoRankGather(lambda t: t.clone())
    total, _ = ALGORITHMS["allgather"](comm, comp, x.clone(), ctx, {}).wait()
    dtotal, _ = ALGORITHMS["allgather"](comm, comp, x.clone(), ctx, {}, Want(deferred=True)).wait()
    out = torch.empty(n)
    dtotal.into_(out)
    nan = torch.isnan(total)
    assert nan.any() and torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int32), total[~nan].view(torch.int32))


@pytest.mark.parametrize("spec,alg", [("topk:density=0.01", "allgather"), ("randomk:density=0.02", "allgather"),
                                      ("randomk:density=0.02", "allreduce")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_own_residual_equals_x_minus_decode(spec, alg, dtype):
    """A sparsifier's ``own`` comes back as a :class:`SparseOwn`: its residual (``x`` copied,
    then ``x - v`` at the indices) has the bits of ``x - decode(own)``: -0 sent and not sent,
    inf and NaN; on the allreduce its values survive the in-place sum of the payload."""
    from compressors.deferred import SparseOwn

    comp = from_spec(spec)
    n = 30_011
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    x[::53] = -0.0
    x[7], x[11], x[13] = float("inf"), float("nan"), -float("inf")
    ctx = Context(numel=n, dtype=dtype, step=5, bucket=2)
    if alg == "allgather":
        comm = TwoRankGather(lambda t: t.clone())
    else:
        from test_cast_deferred import OtherRankComm
        comm = OtherRankComm(torch.randn(comp.k_for(n), generator=g).to(dtype))
    _, own = ALGORITHMS[alg](comm, comp, x.clone(), ctx, {}).wait()
    xd = x.clone()
    _, down = ALGORITHMS[alg](comm, comp, xd, ctx, {}, Want(deferred=True)).wait()
    assert isinstance(down, SparseOwn)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    r = torch.full((n,), 7.0, dtype=dtype)
    assert down.residual_(xd, r) is r
    want = torch.sub(x, own)
    nan = torch.isnan(want)
    assert nan.any() and torch.equal(torch.isnan(r), nan)
    assert torch.equal(r[~nan].view(bits), want[~nan].view(bits))
    m = down.materialize()
    assert torch.equal(torch.isnan(m), torch.isnan(own)) and torch.equal(m.nan_to_num().view(bits), own.nan_to_num().view(bits))
    assert (own != 0).sum() > 0 and ((r == 0) & (x != 0)).sum() > 0  # something was sent and left the residual


def test_sparse_own_of_another_tensor_falls_back():
    from compressors.deferred import SparseOwn

    comp = from_spec("topk:density=0.1")
    x = torch.randn(1000)
    ctx = Context(numel=1000)
    own = comp.deferred_own(x, comp.compress(x, ctx), ctx)
    assert isinstance(own, SparseOwn)
    y = x + 1
    r = torch.empty(1000)
    own.residual_(y, r)
    assert torch.equal(r, torch.sub(y, comp.decompress(comp.compress(x, ctx), ctx)))


@pytest.mark.parametrize("spec,alg,decodes", [("qsgd:bits=4", "allgather", 0), ("sign", "allgather", 0),
                                              ("fp16", "allreduce", 0), ("randomk:density=0.02", "allreduce", 1)])
def test_own_not_wanted_is_not_decoded(spec, alg, decodes, monkeypatch):
    """``own=False`` (the hook without error feedback or masking): ``own`` comes back None and
    the compressor never decodes this rank's payload alone (random-k's one decode on the
    allreduce is the sum's); the aggregate keeps its bits."""
    from compressors.deferred import Deferred

    comp = from_spec(spec)
    n = 20_011
    x = torch.randn(n, generator=torch.Generator().manual_seed(6))
    ctx = Context(numel=n, step=4, bucket=0)
    if alg == "allgather":
        comm = TwoRankGather(lambda t: t.clone())
    else:
        from test_cast_deferred import OtherRankComm
        k = comp.k_for(n) if hasattr(comp, "k_for") else n
        comm = OtherRankComm(torch.randn(k, generator=torch.Generator().manual_seed(7)))
    total, _ = ALGORITHMS[alg](comm, comp, x.clone(), ctx, {}).wait()
    calls = []
    real = type(comp).decompress_into
    monkeypatch.setattr(type(comp), "decompress_into", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    dtotal, down = ALGORITHMS[alg](comm, comp, x.clone(), ctx, {}, Want(deferred=True, own=False)).wait()
    assert down is None and len(calls) == decodes
    got = dtotal.into_(torch.full((n,), 7.0)) if isinstance(dtotal, Deferred) else dtotal
    assert torch.equal(got.view(torch.int32), total.view(torch.int32))


class HeldGather:
    """An allgather / allreduce whose round completes only when the test says so."""

    rank, world_size, backend = 0, 2, "local"

    def __init__(self):
        self.pending = []

    def _held(self, value):
        f = torch.futures.Future()
        self.pending.append((f, value))
        return f

    def all_gather(self, t):
        return self._held(torch.cat([t, t]))

    def all_reduce(self, t):
        return self._held(t.mul_(2))

    def complete(self):
        for f, v in self.pending:
            f.set_result(v)


@pytest.mark.parametrize("spec,alg", [("topk:density=0.01", "allgather"), ("sign", "allgather"),
                                      ("fp16", "allreduce"), ("randomk:density=0.02", "allreduce"),
                                      ("randomk:density=0.02", "allgather")])
def test_on_own_runs_while_the_round_is_on_the_wire(spec, alg):
    """``on_own`` (the hook's residual, with error feedback and no masking) gets this rank's
    own contribution before the round completes; ``own`` then comes back None, and the
    residual written from it has the bits of ``x - own``."""
    comp = from_spec(spec)
    n = 20_011
    x = torch.randn(n, generator=torch.Generator().manual_seed(8))
    x[::37] = -0.0
    ctx = Context(numel=n, step=4, bucket=0)
    ref_comm = HeldGather()
    ref_fut = ALGORITHMS[alg](ref_comm, comp, x.clone(), ctx, {})
    ref_comm.complete()
    ref_total, ref_own = ref_fut.wait()
    got = []
    xd = x.clone()
    r = torch.full((n,), 7.0)
    comm = HeldGather()
    def on_own(o):  # what the hook does: ErrorFeedback.update_
        got.append(materialized(o).clone())
        return o.residual_(xd, r) if isinstance(o, Deferred) else torch.sub(xd, o, out=r)

    fut = ALGORITHMS[alg](comm, comp, xd, ctx, {}, Want(deferred=True, on_own=on_own))
    assert len(got) == 1 and not fut.done()  # handed over while the round is pending
    comm.complete()
    dtotal, down = fut.wait()
    assert down is None
    assert torch.equal(got[0].view(torch.int32), ref_own.view(torch.int32))
    assert torch.equal(r.view(torch.int32), torch.sub(x, ref_own).view(torch.int32))
    out = dtotal.into_(torch.empty(n)) if isinstance(dtotal, Deferred) else dtotal
    assert torch.equal(out.view(torch.int32), ref_total.view(torch.int32))


class SameDataTwoRanks:
    """two_phase's rounds at world size 2 as rank 0 sees them when rank 1 holds the same
    bucket: every rank's payload for chunk 0 is this rank's, and owner 1's phase-2 payload
    stands in as a copy of owner 0's (layouts agree for a flat bucket)."""

    rank, world_size, backend = 0, 2, "local"

    def _done(self, v):
        f = torch.futures.Future()
        f.set_result(v)
        return f

    def all_to_all(self, send):
        row = send.view(2, -1)[0]
        return self._done(torch.cat([row, row]))

    def all_gather(self, t):
        return self._done(torch.cat([t, t]))

    def all_reduce(self, t):  # the layout check's agreement round
        return self._done(t)


@pytest.mark.parametrize("spec", ["topk:density=0.01", "sign", "qsgd:bits=4"])
@pytest.mark.parametrize("n", [10_002, 10_001])  # the second: a short last chunk
def test_two_phase_owner_chunks_into_bucket(spec, n):
    from comms.algorithms.two_phase import OwnerChunks

    comp = from_spec(spec)
    x = torch.randn(n, generator=torch.Generator().manual_seed(9)) * 2
    ctx = Context(numel=n, step=6, bucket=3)
    total, own = ALGORITHMS["two_phase"](SameDataTwoRanks(), comp, x.clone(), ctx, {}).wait()
    dtotal, down = ALGORITHMS["two_phase"](SameDataTwoRanks(), comp, x.clone(), ctx, {}, Want(deferred=True)).wait()
    assert isinstance(dtotal, OwnerChunks) and torch.equal(down, own)
    out = torch.full((n,), 7.0)
    assert dtotal.into_(out) is out
    assert torch.equal(out.view(torch.int32), total.view(torch.int32))
    assert torch.equal(dtotal.materialize().view(torch.int32), total.view(torch.int32))
    got = []
    _, none = ALGORITHMS["two_phase"](SameDataTwoRanks(), comp, x.clone(), ctx, {}, Want(deferred=True, on_own=lambda o: got.append(o.clone()))).wait()
    assert none is None and torch.equal(got[0], own)


def test_two_phase_return_held_keeps_no_owner_residual():
    """``return_held``: the same aggregate bits, no owner residual kept; an owner residual left
    from before goes into this rank's chunk of ``x`` once (then phase 1 sends it on); a codec
    that does not sparsify is refused before any round."""
    from comms.algorithms.two_phase import _RESIDUAL

    comp = from_spec("topk:density=0.01")
    n = 10_002
    x = torch.randn(n, generator=torch.Generator().manual_seed(4))
    ctx = Context(numel=n, step=2, bucket=0)
    store: dict = {}
    total, own = ALGORITHMS["two_phase"](SameDataTwoRanks(), comp, x.clone(), ctx, store).wait()
    assert _RESIDUAL in store  # the owner's residual (top-k is biased)
    kept = store[_RESIDUAL].clone()
    bare: dict = {}
    t2, o2 = ALGORITHMS["two_phase"](SameDataTwoRanks(), comp, x.clone(), ctx, bare, Want(return_held=True)).wait()
    assert bare == {} and torch.equal(t2, total) and torch.equal(o2, own)
    # a residual from before: added into chunk 0 (this rank's) of x, then dropped from the store
    y = x.clone()
    ALGORITHMS["two_phase"](SameDataTwoRanks(), comp, y, ctx, store, Want(return_held=True)).wait()
    assert _RESIDUAL not in store
    m = -(-n // 2)
    assert torch.equal(y[:m], x[:m] + kept) and torch.equal(y[m:], x[m:])
    with pytest.raises(ValueError, match="sign"):
        ALGORITHMS["two_phase"](SameDataTwoRanks(), from_spec("sign"), x.clone(), ctx, {}, Want(return_held=True))
