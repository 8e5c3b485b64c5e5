"""The compiled CPU codec (csrc/cpu/codec.cpp) against the torch/numpy path: the same bits for
every compressor, shape, dtype, chunk, thread count and non-finite input; the exact top-k
contract (the k largest magnitudes, ties toward the lowest index, indices ascending)."""

import shutil

import pytest
import torch

import compressors.topk as topk_mod
from compressors import QSGD, Context, RandomK, ScaledSign, TopK, cpu_kernels
from compressors.randomk import shared_indices
from unit_reference import topk_exact_compress

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def fallback(monkeypatch):
    """A context manager: inside it the torch/numpy path runs."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        with monkeypatch.context() as m:
            m.setenv(cpu_kernels.ENV_SWITCH, "0")
            assert cpu_kernels.lib() is None
            yield
    return cm


def test_compiled_path_is_what_users_get():
    """Where a compiler exists the default run goes through the kernels (CI included)."""
    if not shutil.which("g++") and not shutil.which("c++"):
        pytest.skip("no C++ compiler: the torch path is what users get")
    assert cpu_kernels.lib() is not None, cpu_kernels.build_error()
    assert cpu_kernels.lib(torch.zeros(1, device="meta")) is None  # other devices: never


def _data(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    if n > 40:
        x[3], x[5], x[17:23] = 0.0, -0.0, 0.0
    return x.to(dtype)


def _nonfinite(n, dtype):
    x = _data(n, torch.float32, 7)
    x[min(5, n - 1)] = float("nan")
    x[n // 2] = float("inf")
    x[(2 * n) // 3] = -float("inf")
    if n > 200:
        x[100:140] = 1e-40  # r = M/2 / s overflows to inf there (fp32)
        x[150:160] = -float("nan")
    return x.to(dtype)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32) if t.is_floating_point() else t


def _same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert torch.equal(_bits(u), _bits(v))


def _roundtrip(c, x, ctx):
    if isinstance(c, RandomK):
        c._cache = None  # its indices are cached per step: recompute them on this path
    p = c.compress(x, ctx)
    n = x.numel()
    dec = c.decompress(p, ctx)
    into = c.decompress_into(p, ctx, torch.full((n,), 3.0))
    acc = c.decompress_add_(p, ctx, _data(n, torch.float32, 99))
    return [*p, dec, into, acc]


CODECS = [QSGD(8), QSGD(4), QSGD(2), QSGD(1), QSGD(8, chunk=7), QSGD(2, chunk=3000),
          ScaledSign(), ScaledSign(5), ScaledSign(2048), ScaledSign(40000), TopK(0.01), TopK(0.3),
          TopK(1.0), RandomK(0.01), RandomK(0.3, seed=5), RandomK(1.0)]


@pytest.mark.parametrize("numel,k", [(1, 1), (3, 2), (10007, 101), (1 << 20, 1 << 20),
                                     (25_000_000, 250_000), (70_003, 7)])
def test_randomk_indices_compiled_equals_torch(numel, k, fallback):
    """cp_randomk_indices: the torch twin's integers (a keyed bijection, cycle-walked)."""
    if cpu_kernels.lib() is None:
        pytest.skip("no compiled kernels here")
    for key in (0, 12345, 0xFFFFFFFF):
        got = shared_indices(numel, k, key)
        with fallback():
            want = shared_indices(numel, k, key)
        assert got.dtype == torch.int64 and torch.equal(got, want), (numel, k, key)
        assert int(got.max()) < numel and got.unique().numel() == k


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("c", CODECS, ids=repr)
def test_compiled_equals_fallback(c, threads, fallback):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (1, 9, 4097, 70_003):
            for dtype in DTYPES if n == 4097 else DTYPES[:1]:
                for make in (_data, lambda n, d, s: _nonfinite(n, d)):
                    if isinstance(c, TopK) and make is not _data and dtype != torch.float32:
                        continue
                    x = make(n, dtype, n)
                    ctx = Context.of(x, step=3, bucket=1, rank=2, seed=4)
                    got = _roundtrip(c, x, ctx)
                    with fallback():
                        want = _roundtrip(c, x, ctx)
                    _same(got, want)
    finally:
        torch.set_num_threads(old)


def test_tensor_aligned_layout_equal(fallback):
    shapes = ((300,), (17, 5), (1,), (2000,))
    x = _data(sum(torch.Size(s).numel() for s in shapes), torch.float32, 1)
    ctx = Context.of(x, step=2, shapes=shapes)
    for c in (QSGD(4, chunk=64), ScaledSign(16)):
        got = _roundtrip(c, x, ctx)
        with fallback():
            _same(got, _roundtrip(c, x, ctx))


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_topk_contract(dtype, fallback):
    g = torch.Generator().manual_seed(0)
    cases = {
        "random": torch.randn(200_003, generator=g),
        # ties at the k-th magnitude: many equal values, mixed signs
        "ties": torch.randint(-3, 4, (100_000,), generator=g).float(),
        # mostly zeros: the k-th magnitude is 0 (the counting fallback inside the kernel)
        "zeros": torch.zeros(300_000).index_fill_(0, torch.arange(0, 300_000, 997), -2.0),
        "nan_inf": torch.randn(50_000, generator=g).index_fill_(0, torch.tensor([3, 9]), float("nan"))
        .index_fill_(0, torch.tensor([4]), float("inf")),
        "clustered": torch.cat([torch.randn(150_000, generator=g) * 1e-3,
                                torch.randn(4_000, generator=g) * 10]),  # large ones in one place
    }
    for name, x in cases.items():
        x = x.to(dtype)
        for density in (0.01, 0.001, 0.2):
            c = TopK(density)
            k = c.k_for(x.numel())
            vals, idx = c.compress(x, Context.of(x))
            want = topk_exact_compress(x, density)
            assert torch.equal(idx, want[1]), (name, density)
            assert torch.equal(_bits(vals), _bits(want[0])), (name, density)
            assert bool((idx[1:] > idx[:-1]).all())  # ascending
            mag = x.float().abs()
            ref = torch.topk(mag, k)
            # the multiset of magnitudes always equals torch.topk's; the set too without a tie
            # at the boundary
            assert torch.equal(torch.sort(mag[idx.long()]).values.nan_to_num(),
                               torch.sort(ref.values).values.nan_to_num())
            kth = ref.values.min()
            if int((mag == kth).sum()) == 1 and not torch.isnan(kth):
                assert set(idx.tolist()) == set(ref.indices.tolist())
            with fallback():
                got = c.compress(x, Context.of(x))
            assert torch.equal(got[1], idx) and torch.equal(_bits(got[0]), _bits(vals))


def test_exact_topk_fp64():
    """fp64 buckets (no kernel; a 63-bit magnitude key leaves no room for the index): the same
    contract — ties at the k-th magnitude toward the lowest indices, NaN above inf."""
    g = torch.Generator().manual_seed(3)
    for x in (torch.randn(20_011, generator=g, dtype=torch.float64),
              torch.randint(-3, 4, (10_000,), generator=g).double(),
              torch.randn(5_000, generator=g, dtype=torch.float64).index_fill_(0, torch.tensor([3, 9]), float("nan"))
              .index_fill_(0, torch.tensor([4]), -float("inf"))):
        for density in (0.01, 0.2):
            vals, idx = TopK(density).compress(x, Context.of(x))
            want = topk_exact_compress(x, density)
            assert torch.equal(idx, want[1]) and torch.equal(vals.view(torch.int64), want[0].view(torch.int64))


def test_exact_topk_takes_both_kernel_paths():
    if cpu_kernels.lib() is None:
        pytest.skip("no compiled kernels here")
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    TopK(0.01).compress(x, Context.of(x))
    assert topk_mod._last_exact_path == 1  # the sampled threshold
    TopK(0.01).compress(torch.zeros(1_000_000), Context(numel=1_000_000))
    assert topk_mod._last_exact_path == 3  # every magnitude tied: the counting fallback


def test_sign_scale_selfcheck_agrees_with_torch():
    import compressors.sign as S
    ck = cpu_kernels.lib()
    if ck is None:
        pytest.skip("no compiled kernels here")
    if not torch.backends.cpu.get_cpu_capability().upper().startswith(("AVX2", "AVX512")):
        pytest.skip("the compiled sums follow x86 torch's 8/16-lane orders only")
    # x86 torch sums in 8 lanes (AVX2) or 16; the self-check must find the width at every chunk
    # size, the cascade (>= 16 groups of four vectors: 2048, 3000) and a tail (129) included.
    # On an AVX-512 Xeon torch reports AVX512 and still sums in 8 lanes (2026-12-03): checking
    # only the capability's width declined the kernel there.
    S._LANES_OK.clear()
    for chunk in (1, 5, 8, 128, 129, 2048, 3000):
        assert S._kernel_lanes(ck, chunk) in cpu_kernels.SUM_LANES, chunk
    # and the width it found gives torch's bits on fresh data, not only on the self-check's rows
    x = torch.randn(40_000, generator=torch.Generator().manual_seed(7))
    for chunk in (128, 2048):
        codec = S.ScaledSign(chunk, align="flat")
        got = torch.empty(codec.nchunks(x.numel()))
        bits = torch.empty(S.packed_nbytes(x.numel(), 1), dtype=torch.uint8)
        ck.cp_sign_encode(x.data_ptr(), 0, x.numel(), chunk, S._kernel_lanes(ck, chunk),
                          got.data_ptr(), bits.data_ptr(), 1)
        assert torch.equal(got.view(torch.int32), codec._scales(x).view(torch.int32)), chunk


@pytest.mark.parametrize("world,bits", [(2, 8), (4, 4), (32, 8)])  # int8 wire, and int32 (32 ranks)
@pytest.mark.parametrize("threads", [1, 2])
def test_shared_scale_kernel_equals_reference(world, bits, threads, monkeypatch):
    """comms/algorithms/shared_scale.py: the compiled quantize/decode give the bits of the
    torch reference, with NaN, inf, zeros, tiny shared scales and a short last chunk."""
    from comms.algorithms.shared_scale import (decode_cpu, decode_reference, quantize_cpu, quantize_reference, shared_scale_levels)

    if cpu_kernels.lib() is None:
        pytest.skip(f"no compiled codec: {cpu_kernels.build_error()}")
    monkeypatch.setattr(cpu_kernels, "threads", lambda: threads)
    chunk, n = 256, 256 * 37 + 19
    g = torch.Generator().manual_seed(world * 10 + bits)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 4, (n,), generator=g).float()
    x[5], x[300], x[301] = float("nan"), float("inf"), -float("inf")
    x[512:768] = 0.0  # an all-zero chunk (scale 0)
    x[1024:1280] = 1e-39  # a denormal scale: L / s overflows to inf, 0 * inf = NaN -> 0
    x[1024] = 0.0
    nch = -(-n // chunk)
    scales = torch.stack([x[i * chunk:(i + 1) * chunk].abs().amax() for i in range(nch)])
    scales = torch.maximum(scales, torch.rand(nch, generator=g) * 0.5)  # other ranks' larger maxima
    scales[2], scales[4] = 0.0, 1e-39
    levels, wire = shared_scale_levels(bits, world)
    key = 0xDEADBEEF
    q_ref, t_ref, step_ref = quantize_reference(x, chunk, scales, levels, wire, key)
    q, own, step = quantize_cpu(x, chunk, scales, levels, wire, key)
    assert q.dtype == wire and torch.equal(q, q_ref)
    own_ref = t_ref.clone()
    for i in range(nch):
        own_ref[i * chunk:(i + 1) * chunk].mul_(step_ref[i])
    assert torch.equal(step.view(torch.int32), step_ref.view(torch.int32))
    assert torch.equal(own.view(torch.int32), own_ref.view(torch.int32))
    # any part quantized alone gets the whole bucket's bits (the pipelined round's parts)
    qp, ownp = torch.full_like(q, 99), torch.full_like(own, 7.0)
    cuts = [0, 1, chunk - 3, chunk, 2 * chunk + 5, 9 * chunk, n - 7, n]
    for lo, hi in zip(cuts, cuts[1:]):
        quantize_cpu(x, chunk, scales, levels, wire, key, lo, hi, out=(qp, ownp))
    assert torch.equal(qp, q_ref) and torch.equal(ownp.view(torch.int32), own_ref.view(torch.int32))
    summed = (q_ref.to(torch.int32) * 3).clamp(-levels * world, levels * world).to(wire)
    for dtype in (torch.float32, torch.bfloat16):
        ref = decode_reference(summed, chunk, step_ref, dtype)
        got = decode_cpu(summed, chunk, step_ref, dtype)
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           ref.view(torch.int16 if dtype != torch.float32 else torch.int32))
    ref = decode_reference(summed, chunk, step_ref, torch.float32)
    part_out = torch.full((n,), 5.0)
    for lo, hi in zip(cuts, cuts[1:]):
        decode_cpu(summed[lo:hi], chunk, step_ref, torch.float32, lo, part_out)
    assert torch.equal(part_out.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("momentum", [0.9, 0.99])
@pytest.mark.parametrize("threads", [1, 2])
def test_momentum_pass_equals_torch_steps(world, momentum, threads, fallback, monkeypatch):
    """``x / world``, ``u <- m u + x`` and ``x <- u (+ r)`` in one compiled pass: the bits of
    ``x.div_(world)`` then the torch momentum (and residual) steps, incl. -0, denormals, inf
    and NaN, over several steps of both entry points."""
    from comms.core.memory import LocalMemory

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(world * 10 + threads)
    fast, ref = LocalMemory(), LocalMemory()
    for step in range(4):
        x = torch.randn(200_003, generator=g) * 10.0 ** (step - 2)
        x[::97] = -0.0
        x[5::1009] = 1e-41  # denormal
        if step == 3:
            x[7], x[8] = float("inf"), float("nan")
        for bucket, fused_entry in ((0, False), (1, True)):
            xf, xr = x.clone(), x.clone()
            if fused_entry:
                fast.momentum_residual_(bucket, xf, momentum, world)
                with fallback():
                    ref.momentum_residual_(bucket, xr, momentum, world)
            else:
                fast.momentum_(bucket, xf, momentum, world)
                with fallback():
                    xr.div_(world)  # the torch steps exactly as the hook ran them before
                    ref.momentum_(bucket, xr, momentum)
            assert torch.equal(xf.view(torch.int32), xr.view(torch.int32)), (step, bucket)
            assert torch.equal(fast.velocities[bucket].view(torch.int32),
                               ref.velocities[bucket].view(torch.int32)), (step, bucket)
            if fused_entry:  # a residual for the next step's fused pass
                own = torch.where(xr.abs() > 1.0, xr, torch.zeros_like(xr))
                fast.update_(bucket, xf, own)
                ref.update_(bucket, xr, own)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_div_residual_pass_equals_torch_steps(world, threads, fallback, monkeypatch):
    """``x <- x / world + r`` in one compiled pass: the bits of ``x.div_(world)`` then
    ``add_residual_``, incl. -0, denormals, inf and NaN, over three steps (the first has no
    residual yet)."""
    from comms.core.memory import LocalMemory

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(world + 10 * threads)
    fast, ref = LocalMemory(), LocalMemory()
    for step in range(3):
        x = torch.randn(200_003, generator=g) * 10.0 ** (step - 1)
        x[::89] = -0.0
        x[5::1009] = 1e-41
        if step == 2:
            x[7], x[8], x[9] = float("inf"), float("nan"), -float("inf")
        xf, xr = x.clone(), x.clone()
        fast.last_amax = None
        fast.div_residual_(0, xf, world)
        with fallback():
            xr.div_(world)
            ref.add_residual_(0, xr)
        assert torch.equal(xf.view(torch.int32), xr.view(torch.int32)), step
        if step:  # the compiled pass (from the second step: a residual exists) saw max |x|
            assert fast.last_amax == int((xr.view(torch.int32) & 0x7FFFFFFF).max()), step
        own = torch.where(xr.abs() > 0.5, xr, torch.zeros_like(xr))
        fast.update_(0, xf, own)
        ref.update_(0, xr, own)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_velocity", [True, False])
def test_ef_update_with_masking_equals_torch_steps(threads, with_velocity, fallback, monkeypatch):
    """``r <- x - own`` and momentum factor masking (``u[own != 0] = 0``) in one compiled pass:
    the bits of ``update_`` then ``mask_velocity_`` (the torch steps), incl. -0 in ``own``
    (not sent: its velocity stays), NaN and inf, over three steps."""
    from comms.core.memory import LocalMemory

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(threads)
    fast, ref = LocalMemory(), LocalMemory()
    for step in range(3):
        x = torch.randn(300_007, generator=g)
        x[3::1013] = 1e-41
        own = torch.where(x.abs() > 1.5, x * 0.75, torch.zeros_like(x))  # a sparsifier's own
        own[::101] = -0.0
        if step == 2:
            own[9], own[10], x[11] = float("nan"), float("inf"), float("-inf")
        if with_velocity:
            u = torch.randn(x.numel(), generator=g)
            fast.velocities[0], ref.velocities[0] = u.clone(), u.clone()
        r_fast = fast.update_masked_(0, x, own)
        with fallback():
            r_ref = ref.update_(0, x, own)
            ref.mask_velocity_(0, own)
        assert r_fast is fast.residuals[0]
        assert torch.equal(r_fast.view(torch.int32), r_ref.view(torch.int32)), step
        if with_velocity:
            assert torch.equal(fast.velocities[0].view(torch.int32),
                               ref.velocities[0].view(torch.int32)), step
            assert int((fast.velocities[0] == 0).sum()) >= int((own != 0).sum())
        else:
            assert 0 not in fast.velocities


@pytest.mark.parametrize("threads", [1, 2])
def test_ef_update_held_equals_torch_steps(threads, fallback, monkeypatch):
    """``r <- x - own`` and the default masking (``u[(own != 0) & (agg == 0)] = 0``) in one
    compiled pass: the bits of ``update_`` then ``mask_velocity_`` given ``agg`` (the torch
    steps), incl. -0 in ``own`` and ``agg``, NaN and inf, over three steps; the first step (no
    residual yet) takes the torch steps."""
    from comms.core.memory import LocalMemory

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(10 + threads)
    fast, ref = LocalMemory(), LocalMemory()
    u = torch.randn(300_007, generator=g)
    fast.velocities[0], ref.velocities[0] = u.clone(), u.clone()
    for step in range(3):
        x = torch.randn(300_007, generator=g)
        own = torch.where(x.abs() > 1.5, x * 0.75, torch.zeros_like(x))
        own[::101] = -0.0
        agg = torch.where(torch.rand(x.numel(), generator=g) < 0.5, own * 2, torch.zeros_like(x))
        agg[::77] = -0.0
        if step == 2:
            own[9], own[10], agg[12], x[11] = float("nan"), float("inf"), float("nan"), float("-inf")
        r_fast = fast.update_masked_(0, x, own, agg)
        with fallback():
            r_ref = ref.update_(0, x, own)
            ref.mask_velocity_(0, own, agg)
        assert r_fast is fast.residuals[0]
        assert torch.equal(r_fast.view(torch.int32), r_ref.view(torch.int32)), step
        assert torch.equal(fast.velocities[0].view(torch.int32), ref.velocities[0].view(torch.int32)), step
        held = (own != 0) & (agg == 0)
        assert bool(held.any()) and bool((fast.velocities[0][held] == 0).all())
        fast.velocities[0].add_(1.0)  # nonzero again for the next step's check
        ref.velocities[0].add_(1.0)


def test_hook_flag_from_the_pass_max():
    """The hook's non-finite flag from the fused pass's max |x| bits: NaN and inf flag, and so
    does a finite bucket whose sum could leave fp32's range; ordinary values do not."""
    import struct

    from comms.core.stages import _nonfinite_or_overflows as flag

    bits = lambda v: struct.unpack("<I", struct.pack("<f", v))[0]  # noqa: E731
    assert flag(0x7F800000, 10) and flag(0x7FC00000, 10)  # inf, NaN
    assert not flag(bits(3.0e38), 1) and flag(bits(3.0e38), 2)
    assert not flag(bits(1.0), 25_000_000) and not flag(0, 5)
    assert flag(bits(1e31), 100_000_000) and not flag(bits(1e30), 100_000_000)
