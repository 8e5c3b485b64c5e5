"""Rank bodies that call the aggregation algorithms directly (no DDP): used by the gloo
tests (through ``comms.cluster.launch.spawn``) and by the MPI script (under ``mpiexec``).

Every check runs on every rank and asserts locally; results are also returned for the
parent to compare. Inputs of all ranks are generated on every rank, so each rank can build
the dense reference without communication.
"""

from __future__ import annotations

import torch

import compressors
from comms.algorithms import ALGORITHMS
from comms.transport.communicator import Communicator

# every registered compressor's examples() (e.g. qsgd:bits=8/4/2, powersgd:rank=2): a
# compressor that registers itself is in the matrix without editing this file
SPECS = [c.spec() for c in compressors.registry.examples()]
# every registered flat algorithm (hierarchical forms need a topology: tests/dist/test_hierarchical.py)
FLAT = [name for name, alg in ALGORITHMS.items() if not alg.hierarchical]


def matrix():
    """Every (compressor spec, algorithm) pair the compressor supports."""
    out = []
    for spec in SPECS:
        c = compressors.from_spec(spec)
        out += [(spec, a) for a in FLAT if ALGORITHMS[a].supports(c)]
    return out


def inputs(world, n, seed=0, dtype=torch.float32):
    """Every rank's input (already 'divided by world' in spirit: any values work)."""
    xs = []
    for r in range(world):
        g = torch.Generator().manual_seed(10_000 * seed + r)
        x = torch.randn(n, generator=g) * (1 + r)
        x[: n // 7] *= 0.01  # mixed magnitudes across chunks
        xs.append(x.to(dtype))
    return xs


class CountingCommunicator(Communicator):
    """Forwards to a real communicator and counts bytes sent per rank (ring accounting)."""

    def __init__(self, inner):
        self.inner, self.rank, self.world_size, self.backend = inner, inner.rank, inner.world_size, inner.backend
        self.sent = 0.0
        self.ops = 0

    def _count(self, frac_bytes):
        self.sent += frac_bytes
        self.ops += 1

    def all_reduce(self, t):
        w = self.world_size
        self._count(2 * (w - 1) * t.numel() * t.element_size() / w)
        return self.inner.all_reduce(t)

    def all_gather(self, t):
        self._count((self.world_size - 1) * t.numel() * t.element_size())
        return self.inner.all_gather(t)

    def all_to_all(self, t):
        w = self.world_size
        self._count((w - 1) * t.numel() * t.element_size() / w)
        return self.inner.all_to_all(t)

    def reduce_scatter(self, t):
        w = self.world_size
        self._count((w - 1) * t.numel() * t.element_size() / w)
        return self.inner.reduce_scatter(t)

    def broadcast(self, t, src=0):
        self._count(t.numel() * t.element_size() if self.rank == src else 0)
        return self.inner.broadcast(t, src)


def sum_bound(alg, c, xs):
    """Per-element bound on |alg sum - sum(xs)| (fp64) for a fresh store."""
    if hasattr(alg, "error_bound"):
        return alg.error_bound(c, xs)
    world = len(xs)
    absx = sum(x.double().abs() for x in xs)
    b = sum(c.error_bound(x).double() for x in xs)
    wire = getattr(c, "wire_dtype", torch.float32)
    eps = max(torch.finfo(wire).eps, torch.finfo(xs[0].dtype).eps)
    return b + (world + 2) * eps * (absx + b)


def _own_bound(name, c, x, world, sum_bound_):
    if name == "shared_scale":
        return sum_bound_ / world
    if name == "two_phase":  # phase-1 chunks: the compressor's bound per two-phase chunk
        n = x.numel()
        m = -(-n // world)
        xp = torch.cat([x, x.new_zeros(world * m - n)])
        return torch.cat([c.error_bound(xp[j * m:(j + 1) * m]) for j in range(world)])[:n].double()
    return c.error_bound(x).double()


def _equal_everywhere(comm, t):
    """Bitwise equality of ``t`` over ranks (gathered as bytes)."""
    b = t.contiguous().view(torch.uint8).reshape(-1)
    g = comm.all_gather(b).wait().view(comm.world_size, -1)
    return all(torch.equal(g[0], g[r]) for r in range(1, comm.world_size))


def check_matrix(comm, cases=None, n=10007, dtypes=(torch.float32,), seeds=2):
    """Run every case; assert replica identity, accuracy, lossless exactness, wire bytes."""
    rank, world = comm.rank, comm.world_size
    report = []
    for spec, name in cases or matrix():
        c = compressors.from_spec(spec)
        alg = ALGORITHMS[name]
        for dtype in dtypes:
            for seed in range(seeds):
                xs = inputs(world, n, seed, dtype)
                ctx = compressors.Context(numel=n, dtype=dtype, step=seed + 3, bucket=1, rank=rank, seed=7)
                counter = CountingCommunicator(comm)
                total, own = alg(counter, c, xs[rank].clone(), ctx, {}).wait()
                tag = f"{spec} via {name} ({dtype}, seed {seed}, world {world})"
                assert total.dtype == dtype and total.shape == (n,), tag
                assert torch.isfinite(total).all(), tag
                assert _equal_everywhere(comm, total), f"{tag}: replicas differ"
                ref = sum(x.double() for x in xs)
                err = (total.double() - ref).abs()
                bound = sum_bound(alg, c, xs)
                assert bool((err <= bound).all()), f"{tag}: max excess {(err - bound).max().item():.3g}"
                if c.lossless and dtype == torch.float32 and name != "allreduce":
                    rank_order = torch.zeros(n)
                    for x in xs:
                        rank_order += x
                    assert torch.equal(total, rank_order), f"{tag}: not the rank-order sum"
                if c.lossless and world == 2 and dtype == torch.float32:
                    assert torch.equal(total, xs[0] + xs[1]), f"{tag}: not the exact dense sum"
                    assert torch.equal(own, xs[rank]), f"{tag}: own != x"
                own_err = (own.double() - xs[rank].double()).abs()
                own_bound = _own_bound(name, c, xs[rank], world, bound)
                eps = torch.finfo(dtype).eps  # own is rounded to the bucket dtype
                slack = eps * (xs[rank].double().abs() + own_bound) + 1e-6
                assert bool((own_err <= own_bound * (1 + 1e-5) + slack).all()), f"{tag}: own out of bound"
                expect = alg.wire_bytes(c, n, dtype, world)
                assert abs(counter.sent - expect) <= counter.ops, \
                    f"{tag}: wire_bytes {expect} but sent {counter.sent}"
                rel = float((total.double() - ref).norm() / ref.norm())
                report.append((spec, name, str(dtype), seed, rel, expect))
    return report


def check_unbiased(comm, name, spec="qsgd:bits=2", n=4096, samples=48):
    """Mean over seeds of the aggregate converges to the exact sum (unbiased rounding)."""
    rank, world = comm.rank, comm.world_size
    c = compressors.from_spec(spec)
    alg = ALGORITHMS[name]
    xs = inputs(world, n, 0)
    ref = sum(x.double() for x in xs)
    acc = torch.zeros(n, dtype=torch.float64)
    single = None
    for s in range(samples):
        ctx = compressors.Context(numel=n, step=s, bucket=0, rank=rank, seed=11)
        total, _ = alg(comm, c, xs[rank].clone(), ctx, {}).wait()
        acc += total.double()
        if single is None:
            single = float((total.double() - ref).abs().mean())
    mean_err = float((acc / samples - ref).abs().mean())
    # unbiased: error of the mean shrinks like 1/sqrt(samples) (~0.14 here); biased would not
    assert mean_err < 0.3 * single, f"{spec} via {name}: mean error {mean_err:.4g} vs single {single:.4g}"
    return mean_err, single


def check_mismatch(comm, name, spec):
    """Rank 0 passes a different numel, then a different dtype: every rank must raise."""
    rank = comm.rank
    c = compressors.from_spec(spec)
    alg = ALGORITHMS[name]
    raised = []
    for kind in ("numel", "dtype"):
        n = 1000 + (5 if rank == 0 and kind == "numel" else 0)
        dtype = torch.float16 if rank == 0 and kind == "dtype" else torch.float32
        x = torch.randn(n).to(dtype)
        ctx = compressors.Context(numel=n, dtype=dtype, rank=rank)
        try:
            alg(comm, c, x, ctx, {}).wait()
        except ValueError as exc:
            assert "differs across ranks" in str(exc), exc
            raised.append(kind)
    # the communicator is still usable afterwards (nothing half-issued)
    t = torch.ones(3)
    comm.all_reduce(t).wait()
    assert torch.equal(t, torch.full((3,), float(comm.world_size)))
    return raised


def check_shared_scale_parts(comm, n=10007, spec="qsgd:bits=8,chunk=128"):
    """The pipelined shared_scale round (its integer allreduce cut in parts, each decoded as
    it arrives) gives the bits of the one-part round, on every rank, for fp32 and fp16
    buckets; returns the part counts used."""
    import importlib
    mod = importlib.import_module("comms.algorithms.shared_scale")
    c = compressors.from_spec(spec)
    counts = []
    for dtype in (torch.float32, torch.float16):
        xs = inputs(comm.world_size, n, 5, dtype)
        ctx = compressors.Context(numel=n, dtype=dtype, step=4, bucket=2, rank=comm.rank, seed=3)
        results = []
        for part_bytes in (1 << 40, 1000, 4096):
            mod.PART_BYTES = part_bytes
            counts.append(len(mod.part_bounds(n, c.chunk, torch.int8)))
            total, own = ALGORITHMS["shared_scale"](comm, c, xs[comm.rank].clone(), ctx, {}).wait()
            assert _equal_everywhere(comm, total), f"{dtype}, parts of {part_bytes} B: replicas differ"
            results.append((total.clone(), own.clone()))
        mod.PART_BYTES = 4 << 20
        for total, own in results[1:]:
            assert torch.equal(total, results[0][0]) and torch.equal(own, results[0][1]), dtype
    return counts


def gloo_shared_scale_parts(rank, world):
    from comms import TorchCommunicator
    return check_shared_scale_parts(TorchCommunicator())


def gloo_matrix(rank, world, cases, n, dtypes, seeds):
    from comms import TorchCommunicator
    torch.set_num_threads(1)
    return check_matrix(TorchCommunicator(), cases, n, dtypes, seeds)


def gloo_unbiased(rank, world):
    from comms import TorchCommunicator
    comm = TorchCommunicator()
    return [check_unbiased(comm, a) for a in ("two_phase", "shared_scale")]


def gloo_mismatch(rank, world):
    from comms import TorchCommunicator
    comm = TorchCommunicator()
    return [check_mismatch(comm, a, s) for a, s in
            (("two_phase", "qsgd:bits=8"), ("shared_scale", "qsgd:bits=8"))]


ALIGNED_SHAPES = ((300,), (17, 5), (1,), (2000,), (1234,))  # 3620 elements, mixed magnitudes


def check_two_phase_tensor_aligned(comm, spec):
    """two_phase on a bucket whose parameter shapes are known: every chunk's codec restarts
    its scales at each tensor piece it holds (``chunk_shapes``), chunk payloads of different
    sizes are padded on the wire and cut back: the result has the bits of that definition
    computed locally (decode every rank's chunk in rank order, re-compress, decode), equal
    on every rank; no scale mixes a 1e-3 tensor with its 1e3 neighbour; the bytes sent
    are ``bucket_wire_bytes``. Returns each chunk's own payload size (bytes)."""
    import importlib
    import math

    tp = importlib.import_module("comms.algorithms.two_phase")  # the module (the package exports the instance)

    rank, world = comm.rank, comm.world_size
    c = compressors.from_spec(spec)
    shapes = ALIGNED_SHAPES
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)
    scale = torch.cat([torch.full((k,), v) for k, v in zip(sizes, (1e3, 1e-3, 5.0, 1e3, 1e-3))])
    xs = [x * scale for x in inputs(world, n, 3)]
    ctx = compressors.Context(numel=n, step=5, bucket=3, rank=rank, seed=9, shapes=shapes)
    counter = CountingCommunicator(comm)
    total, own = ALGORITHMS["two_phase"](counter, c, xs[rank].clone(), ctx, {}).wait()
    assert _equal_everywhere(comm, total), f"{spec}: replicas differ"
    m = -(-n // world)
    want = []
    for j in range(world):
        acc = torch.zeros(m)
        for i in range(world):
            xi = torch.cat([xs[i], xs[i].new_zeros(world * m - n)])[j * m:(j + 1) * m]
            cj = tp.chunk_context(ctx, world, 1, j, i)
            c.decompress_add_(c.compress(xi, cj), cj, acc)
        c2 = tp.chunk_context(ctx, world, 2, j, j)
        want.append(c.decompress(c.compress(acc, c2), c2))
    want = torch.cat(want)[:n]
    assert torch.equal(total.view(torch.int32), want.view(torch.int32)), f"{spec}: not the tensor-aligned two_phase"
    small = slice(300, 385)  # the 1e-3 tensor between two 1e3 ones
    ref = sum(x for x in xs)
    assert float(total[small].abs().max()) < 10 * float(ref[small].abs().max()), f"{spec}: a scale straddles tensors"
    expect = ALGORITHMS["two_phase"].bucket_wire_bytes(c, ctx, world)
    assert abs(counter.sent - expect) <= counter.ops, f"{spec}: sent {counter.sent}, bucket_wire_bytes {expect}"
    return [sum(k * dt.itemsize for k, dt in c.payload_layout(tp.chunk_context(ctx, world, 1, j, 0)))
            for j in range(world)]


def gloo_two_phase_tensor_aligned(rank, world):
    from comms import TorchCommunicator
    comm = TorchCommunicator()
    return [check_two_phase_tensor_aligned(comm, s) for s in ("sign", "qsgd:bits=4", "qsgd:bits=8,chunk=64")]
