"""Every csrc/ entry point run on the CPU emulator against its torch reference, bit for bit.

The launchers of compressors/cuda/kernels.py and the routing of compressors/cuda/dispatch.py
run unchanged (the emulator is plugged in as the launch backend, dispatch accepts CPU
tensors), so the arguments and launch shapes are the production ones; the launch shapes are
then varied: the launchers' own grid, one block, many more blocks than chunks / work, and a
few blocks so that every grid-stride loop iterates; blocks of 256 and of 32, 64 or 1024
threads; in-order and shuffled schedules, and an interleaved one (scheduling points at memory
accesses, three blocks at once on a worker). The oracles are those of tests/gpu/test_kernels_bitexact.py:
the CPU torch reference of each compressor / algorithm.

Sizes {0, 1, 31, 32, 33, 1000, 65543, 10^6} (10^6 in a few cases only, to stay within the
suite's time budget on 2 cores); chunks that divide n and that do not; bits 1/2/4/8;
fp32/fp16/bf16."""

import importlib
import math

import numpy as np
import pytest
import torch

import compressors
from comms.algorithms.shared_scale import (_STREAM_SALT, decode_reference, quantize_reference, shared_scale_levels)
from comms.algorithms.wire import from_bytes, layout_of, to_bytes
from compressors import bitpack
from compressors.cuda import dispatch, kernels
from comms.algorithms import cuda_kernels as alg_cuda
from compressors.hashrng import stream_key

tp = importlib.import_module("comms.algorithms.two_phase")  # the package attribute is the function
from compressors.qsgd import chunk_absmax
from gpu_helpers import assert_same_bits, assert_same_bits_nan

SMALL = [0, 1, 31, 32, 33, 1000]
SIZES = SMALL + [65543]
BIG = 10**6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (id, EmuBackend options)
SHAPES = [
    ("own", {}),
    ("one-block", {"grid": "one"}),
    ("many-blocks", {"grid": "many", "seed": 11}),
    ("few-blocks", {"grid": "few", "block": 32, "seed": 5}),
    # scheduling points at a quarter of the memory accesses, three blocks interleaved per worker
    ("interleaved", {"block": 64, "seed": 17, "interleave": 0.25, "resident": 3}),
]
SHAPE_IDS = [s for s, _ in SHAPES]


def shape(sid):
    return dict(SHAPES)[sid]


def dtypes_for(sid):
    """All three dtypes with the launchers' own shape; one (rotating) with the others."""
    return DTYPES if sid == "own" else [DTYPES[SHAPE_IDS.index(sid) % 3]]


def make_x(n, dtype=torch.float32, seed=0, zeros_every=0):
    g = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))  # varied magnitudes
    if zeros_every and n:
        x[::zeros_every] = 0.0
        x[1::2 * zeros_every] = -0.0
    return x.to(dtype)


def ctx_for(x, step=3, bucket=1, rank=2, seed=7):
    return compressors.Context(numel=x.numel(), dtype=x.dtype, device=x.device,
                               step=step, bucket=bucket, rank=rank, seed=seed)


# -- QSGD: chunk_absmax, qsgd_quantize_fused, qsgd_quantize_packed, qsgd_dequantize ----------
def _qsgd_sizes(chunk):
    # a block of 256 fibers per chunk costs ~0.15 ms of emulation: small chunks on small sizes
    return SIZES if chunk >= 100 else SMALL if chunk >= 33 else [0, 1, 31, 32, 33, 100]


@pytest.mark.parametrize("sid", SHAPE_IDS)
@pytest.mark.parametrize("chunk", [2048, 100, 33, 1])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_qsgd_compress_decompress(emu, bits, chunk, sid):
    be = emu(**shape(sid))
    q = compressors.QSGD(bits=bits, chunk=chunk)
    for dtype in dtypes_for(sid):
        for n in _qsgd_sizes(chunk):
            x = make_x(n, dtype, zeros_every=17)
            ref = q.compress(x, ctx_for(x))  # the CPU torch reference
            got = (dispatch.qsgd_compress(q, x, ctx_for(x)) if n else
                   kernels.qsgd_compress(x, bits, chunk, stream_key(7, 3, 1, 2)))
            assert_same_bits(got[0], ref[0], f"scales n={n} {dtype}")
            assert_same_bits(got[1], ref[1], f"codes n={n} {dtype}")
            if n == 0:
                continue
            dref = q.decompress(ref, ctx_for(x))
            assert_same_bits(dispatch.qsgd_decompress(q, got, ctx_for(x)), dref, f"decode n={n} {dtype}")
            into = torch.empty(n, dtype=dtype)  # decompress_into's form: decoded in place
            assert dispatch.qsgd_decompress(q, got, ctx_for(x), into) is into
            assert_same_bits(into, dref, f"decode into n={n} {dtype}")
            if dtype == torch.float32:
                acc = make_x(n, seed=99)
                acc_ref = acc.clone().add_(dref)
                assert dispatch.qsgd_decompress_add_(q, got, ctx_for(x), acc) is acc
                assert_same_bits(acc, acc_ref, f"decode-add n={n}")
    names = {name for name, *_ in be.launches}
    if chunk % 8 == 0:
        assert names == {"qsgd_encode_chunks", "qsgd_dequantize"}
    elif (chunk * bits) % 32 == 0:
        assert names == {"qsgd_quantize_fused", "qsgd_dequantize"}
    else:
        assert names == {"chunk_absmax", "qsgd_quantize_packed", "qsgd_dequantize"}


@pytest.mark.parametrize("bits,chunk,dtype", [(1, 2048, torch.float32), (8, 2048, torch.bfloat16),
                                               (4, 1000, torch.float16)])
def test_qsgd_one_million(emu, bits, chunk, dtype):
    emu(workers=2)
    q = compressors.QSGD(bits=bits, chunk=chunk)
    x = make_x(BIG, dtype, zeros_every=101)
    ref = q.compress(x, ctx_for(x))
    got = dispatch.qsgd_compress(q, x, ctx_for(x))
    assert_same_bits(got[0], ref[0], "scales")
    assert_same_bits(got[1], ref[1], "codes")
    assert_same_bits(dispatch.qsgd_decompress(q, got, ctx_for(x)), q.decompress(ref, ctx_for(x)), "decode")


def test_chunk_absmax_alone(emu):
    """chunk_absmax as kernels.chunk_absmax launches it, NaN and signed zeros included."""
    for sid in SHAPE_IDS:
        emu(**shape(sid))
        for dtype in DTYPES:
            for n, chunk in [(0, 7), (1, 1), (31, 32), (1000, 1000), (1000, 33), (65543, 8192)]:
                x = make_x(n, dtype, zeros_every=5)
                if n > 40:
                    x[40] = float("nan")
                assert_same_bits_nan(kernels.chunk_absmax(x, chunk), chunk_absmax(x, chunk), f"n={n} {dtype}")


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_qsgd_non_finite_and_tiny_chunks(emu, bits):
    """NaN chunk (s NaN, r 0), inf (r 0), tiny s (r inf), all-zero and signed-zero chunks: the
    payload bit for bit; the decode under the NaN contract."""
    emu(seed=3)
    for chunk in (64, 32):  # fused (64*bits % 32 == 0 for all) and, with bits 1, generic
        for dtype in DTYPES:
            q = compressors.QSGD(bits=bits, chunk=chunk)
            x = make_x(64 * 8 + 3)
            x[5] = float("nan")
            x[64 + 7] = float("inf")
            x[128:192] = torch.randn(64) * 1e-44  # denormal scale: M/2 / s overflows to inf
            x[192:256] = 0.0
            x[256:320] = -0.0
            x[320 + 9] = float("-inf")
            x = x.to(dtype)
            ref = q.compress(x, ctx_for(x))
            got = dispatch.qsgd_compress(q, x, ctx_for(x))
            assert_same_bits_nan(got[0], ref[0], "scales")  # NaN scales: payload unspecified
            assert_same_bits(got[1], ref[1], "codes")
            assert_same_bits_nan(dispatch.qsgd_decompress(q, got, ctx_for(x)), q.decompress(ref, ctx_for(x)), "decode")


# -- bit packing: pack_bits, unpack_bits -----------------------------------------------------
@pytest.mark.parametrize("sid", SHAPE_IDS)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_unpack(emu, bits, sid):
    emu(**shape(sid))
    for n in SIZES + ([BIG] if sid == "own" and bits in (1, 2) else []):
        g = torch.Generator().manual_seed(n)
        codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
        ref = bitpack.pack(codes, bits)
        got = kernels.pack(codes, bits)
        assert_same_bits(got, ref, f"pack n={n}")
        assert_same_bits(kernels.unpack(got, bits, n), codes, f"unpack n={n}")


def test_pack_high_code_bits_are_masked(emu):
    emu()
    codes = torch.arange(256, dtype=torch.uint8).repeat(4)
    for bits in (1, 2, 4):
        assert_same_bits(kernels.pack(codes, bits), bitpack.pack(codes & ((1 << bits) - 1), bits), f"bits={bits}")


def test_pack_into_misaligned_out_leaves_the_rest(emu):
    emu()
    codes = torch.randint(0, 16, (1001,), dtype=torch.uint8)
    big = torch.full((600,), 0xAB, dtype=torch.uint8)
    out = big[1:1 + bitpack.packed_nbytes(1001, 4)]
    kernels.pack(codes, 4, out=out)
    assert_same_bits(out, bitpack.pack(codes, 4), "packed")
    assert int(big[0]) == 0xAB and bool((big[1 + out.numel():] == 0xAB).all())


# -- ScaledSign: sign_pack, sign_decode ------------------------------------------------------
@pytest.mark.parametrize("sid", SHAPE_IDS)
@pytest.mark.parametrize("chunk", [128, 100, 1])
def test_sign(emu, chunk, sid):
    be = emu(**shape(sid))
    c = compressors.ScaledSign(chunk=chunk)
    for dtype in dtypes_for(sid):
        for n in SIZES + ([BIG] if sid == "own" and chunk == 128 and dtype == torch.float32 else []):
            x = make_x(n, dtype, zeros_every=13)
            ref = c.compress(x, ctx_for(x))
            if n == 0:
                assert_same_bits(kernels.sign_pack(x), ref[1], "empty")
                continue
            got = dispatch.sign_compress(c, x, ctx_for(x))
            assert_same_bits(got[0], ref[0], f"scales n={n}")  # torch's reduction (the caller's)
            assert_same_bits(got[1], ref[1], f"sign bits n={n} {dtype}")
            dref = c.decompress(ref, ctx_for(x))
            assert_same_bits(dispatch.sign_decompress(c, got, ctx_for(x)), dref, f"decode n={n} {dtype}")
            into = torch.empty(n, dtype=dtype)
            assert dispatch.sign_decompress(c, got, ctx_for(x), into) is into
            assert_same_bits(into, dref, f"decode into n={n} {dtype}")
            if dtype == torch.float32:
                acc = make_x(n, seed=5)
                acc_ref = acc.clone().add_(dref)
                dispatch.sign_decompress_add_(c, got, ctx_for(x), acc)
                assert_same_bits(acc, acc_ref, f"decode-add n={n}")
    assert {name for name, *_ in be.launches} == {"sign_pack", "sign_decode"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_nan_and_signed_zero(emu, dtype):
    """-0.0 -> bit 1, NaN -> bit 0; a NaN scale decodes to NaN (NaN contract: sign and payload
    unspecified, the kernel's -s flips a NaN's sign where torch's (2b-1)*s may not)."""
    emu()
    c = compressors.ScaledSign(chunk=8)
    x = make_x(37, dtype)
    x[0], x[1], x[9], x[20] = -0.0, float("nan"), float("-nan"), float("inf")
    ref = c.compress(x, ctx_for(x))
    got = dispatch.sign_compress(c, x, ctx_for(x))
    assert_same_bits(got[1], ref[1], "bits")
    assert (int(got[1][0]) & 3) == 1  # bit 0 (-0.0) set, bit 1 (NaN) clear
    assert_same_bits_nan(got[0], ref[0], "scales")
    assert_same_bits_nan(dispatch.sign_decompress(c, got, ctx_for(x)), c.decompress(ref, ctx_for(x)), "decode")


# -- top-k: topk_compact, topk_scatter_add ---------------------------------------------------
@pytest.mark.parametrize("sid", SHAPE_IDS)
def test_topk_compact_finds_every_candidate(emu, sid):
    """Unordered compaction: sorted slots == torch.nonzero(|x| >= thr); count may exceed cap,
    then exactly cap distinct candidates are written."""
    emu(**shape(sid))
    for dtype in dtypes_for(sid):
        for n in SIZES:
            x = make_x(n, dtype, zeros_every=7)
            thr = (x.float().abs().median() if n else torch.tensor(1.0)).to(dtype)
            want = torch.nonzero(x.abs() >= thr).flatten().to(torch.int32)
            for cap in (want.numel() + 3, max(1, want.numel() // 3)):
                slots, count = kernels.topk_compact(x, thr, cap)
                assert int(count) == want.numel(), f"count n={n} {dtype}"
                written = slots[:min(cap, want.numel())]
                if cap >= want.numel():
                    assert_same_bits(torch.sort(written).values, want, f"slots n={n} {dtype}")
                else:
                    assert written.unique().numel() == written.numel()
                    assert bool(torch.isin(written, want).all())


@pytest.mark.parametrize("sid", SHAPE_IDS)
@pytest.mark.parametrize("density", [0.01, 0.05])
def test_topk_compress_matches_reference(emu, density, sid):
    be = emu(**shape(sid))
    c = compressors.TopK(density=density, exact=False, sample=0.01)
    for dtype in dtypes_for(sid):
        for n in [1000, 65543] + ([BIG] if sid == "own" and dtype == torch.float32 else []):
            x = make_x(n, dtype)
            got = dispatch.topk_compress(c, x, ctx_for(x))
            ref = c.compress(x, ctx_for(x))
            assert_same_bits(got[0], ref[0], f"values n={n} {dtype}")
            assert_same_bits(got[1], ref[1], f"indices n={n} {dtype}")
            acc = make_x(n, seed=3, zeros_every=11).float()
            acc_ref = acc.clone().index_add_(0, ref[1].long(), ref[0].float())
            assert dispatch.topk_decompress_add_(c, got, ctx_for(x), acc) is acc
            assert_same_bits(acc, acc_ref, f"scatter-add n={n} {dtype}")
    assert {name for name, *_ in be.launches} == {"topk_compact", "topk_scatter_add"}


def test_topk_threshold_too_low_reruns_with_full_capacity(emu):
    emu(seed=2)
    c = compressors.TopK(density=0.01, exact=False)
    x = torch.ones(200_000)
    x[::3] = -1.0
    got = dispatch.topk_compress(c, x, ctx_for(x))
    ref = c.compress(x, ctx_for(x))
    assert_same_bits(got[1], ref[1], "indices")
    assert_same_bits(got[0], ref[0], "values")


@pytest.mark.parametrize("sid", SHAPE_IDS)
def test_scatter_add_subnormals_pads_and_signed_zeros(emu, sid):
    """index_add_'s bits, including subnormal values and sums (the GPU's float atomicAdd on
    global memory flushes them to zero: the kernel must not use it), zero-valued pads at index
    0 and -0.0 accumulators; fp16/bf16 values widen exactly."""
    emu(**shape(sid))
    tiny = 1e-40  # subnormal in fp32
    for dtype in DTYPES:
        n, k = 1000, 300
        g = torch.Generator().manual_seed(1)
        idx = torch.randperm(n, generator=g)[:k].to(torch.int32)
        vals = (torch.randn(k, generator=g) * 1e-3).to(dtype)
        if dtype == torch.float32:
            vals[:50] = torch.randn(50, generator=g) * tiny
        idx[-20:] = 0
        vals[-20:] = 0.0  # the reference's pads: index 0, value +0
        acc = torch.randn(n, generator=g)
        acc[:100] = torch.randn(100, generator=g) * tiny
        acc[idx[50:60].long()] = -0.0
        acc[0] = -0.0
        ref = acc.clone().index_add_(0, idx.long(), vals.float())
        got = kernels.scatter_add_(acc, idx, vals)
        assert_same_bits(got, ref, f"{dtype}")


def test_scatter_add_skips_out_of_range_indices(emu):
    """The kernel's contract (documented in csrc/topk.cu): slots with an index outside [0, n)
    are skipped and the others applied; torch's index_add_ raises instead. TopK payloads are
    always in range, so this only matters for corrupt input, which the kernel path does not
    detect (that would need a host synchronisation)."""
    emu(seed=9)
    acc = torch.zeros(10)
    idx = torch.tensor([3, -1, 10, 2**31 - 1, 7], dtype=torch.int32)
    vals = torch.tensor([1.5, 100.0, 100.0, 100.0, -2.0])
    kernels.scatter_add_(acc, idx, vals)
    assert acc.tolist() == [0, 0, 0, 1.5, 0, 0, 0, -2.0, 0, 0]
    with pytest.raises(IndexError):
        torch.zeros(10).index_add_(0, idx.long(), vals)


# -- shared-scale integer quantization: shared_scale_encode, shared_scale_decode -------------
@pytest.mark.parametrize("sid", SHAPE_IDS)
@pytest.mark.parametrize("bits,world", [(8, 2), (4, 2), (8, 32)])
def test_shared_scale(emu, bits, world, sid):
    be = emu(**shape(sid))
    levels, wire = shared_scale_levels(bits, world)
    for dtype in dtypes_for(sid):
        for n in SIZES:
            for chunk in [2048, 100]:
                x = make_x(n, dtype, zeros_every=9)
                xf = x.float()
                scales = chunk_absmax(xf, chunk) * 1.5  # the max over ranks is >= own max
                key = stream_key(7, 3, 1 ^ _STREAM_SALT, 2)
                q_ref, t, step = quantize_reference(xf, chunk, scales, levels, wire, key)
                own_ref = tp_own(t, step, chunk, dtype)
                q, own, step_k = alg_cuda.shared_scale_quantize(xf, chunk, scales, levels, wire, key, dtype)
                assert_same_bits(step_k, step, "step")
                assert_same_bits(q, q_ref, f"q n={n} {dtype} chunk={chunk}")
                assert_same_bits(own, own_ref, f"own n={n} {dtype}")
                lim = 127 if wire == torch.int8 else 2**31 - 1
                summed = (q.to(torch.int64) * world).clamp_(-lim, lim).to(wire)
                assert_same_bits(kernels.shared_scale_decode(summed, chunk, step, dtype),
                                 decode_reference(summed, chunk, step, dtype), f"decode n={n} {dtype}")
    assert {name for name, *_ in be.launches} == {"shared_scale_encode", "shared_scale_decode"}


def tp_own(t, step, chunk, dtype):
    from comms.algorithms.shared_scale import _per_chunk_
    return _per_chunk_(t.clone(), step, chunk, "mul_").to(dtype)


@pytest.mark.parametrize("wire_bits", [8, 32])
def test_shared_scale_nan_t_quantizes_to_zero(emu, wire_bits):
    """A NaN t (NaN/inf x; an exact zero in a chunk whose shared scale is tiny, so L/s is inf
    and 0 * inf is NaN) quantizes to 0 in the kernel and in the reference alike (before the
    fix: -L in the kernel, 0 / INT_MIN in the reference's int8 / int32 cast)."""
    emu()
    world = 2 if wire_bits == 8 else 32
    levels, wire = shared_scale_levels(8, world)
    assert wire == (torch.int8 if wire_bits == 8 else torch.int32)
    chunk = 16
    for dtype in DTYPES:
        x = make_x(64, seed=4)
        x[0:16] = 0.0               # chunk 0: tiny shared scale, zeros -> 0 * inf
        x[3] = 1e-38 if dtype == torch.float32 else 0.0
        x[16 + 2] = float("nan")    # chunk 1: NaN scale
        x[32 + 5] = float("inf")    # chunk 2: inf scale
        x = x.to(dtype)
        xf = x.float()
        scales = chunk_absmax(xf, chunk)
        scales[0] = 1e-39           # 0 < s < L / FLT_MAX: inv = inf
        key = stream_key(1, 2, 3 ^ _STREAM_SALT, 0)
        q_ref, t, step = quantize_reference(xf, chunk, scales, levels, wire, key)
        q, own, _ = alg_cuda.shared_scale_quantize(xf, chunk, scales, levels, wire, key, dtype)
        assert q_ref[0].item() == 0 and q_ref[16 + 2].item() == 0 and q_ref[32 + 5].item() == 0
        assert_same_bits(q, q_ref, f"q {dtype}")
        assert_same_bits_nan(own, tp_own(t, step, chunk, dtype), f"own {dtype}")


# -- fused two-phase owner step: two_phase_qsgd_owner ----------------------------------------
def _owner_reference_cpu(q, recv, layout, nb, world, ctx, owner, residual):
    """comms/algorithms/two_phase.py step 3 (torch path) on CPU."""
    m = -(-ctx.numel // world)
    acc = torch.zeros(m, dtype=torch.float32)
    for i in range(world):
        q.decompress_add_(from_bytes(recv[i * nb:(i + 1) * nb], layout),
                          tp.chunk_context(ctx, world, 1, owner, i).with_(dtype=torch.float32), acc)
    owner_in = acc
    if residual is not None:
        owner_in.add_(residual)
    ctx2 = tp.chunk_context(ctx, world, 2, owner, owner)
    p2 = q.compress(owner_in, ctx2)
    res_out = torch.sub(owner_in, q.decompress(p2, ctx2))
    return p2, res_out, ctx2


@pytest.mark.parametrize("sid", SHAPE_IDS)
@pytest.mark.parametrize("bits,chunk", [(1, 2048), (2, 64), (4, 1000), (8, 104)])
def test_two_phase_owner(emu, bits, chunk, sid):
    be = emu(**shape(sid))
    q = compressors.QSGD(bits=bits, chunk=chunk)
    for world in [1, 3, 8]:
        for n in [world, chunk * world + 5, 33 * world] + ([65543] if world == 3 and sid == "own" else []):
            ctx = compressors.Context(numel=n, dtype=torch.float32, step=4, bucket=2, seed=11)
            m = -(-n // world)
            owner = world - 1
            payloads = [q.compress(make_x(m, seed=100 * r), tp.chunk_context(ctx, world, 1, owner, r))
                        for r in range(world)]
            layout = layout_of(payloads[0])
            recv = torch.cat([to_bytes(p) for p in payloads])
            nb = recv.numel() // world
            for residual in (None, make_x(m, seed=5) * 1e-3):
                p2_ref, res_ref, ctx2 = _owner_reference_cpu(q, recv, layout, nb, world, ctx, owner, residual)
                res_out = torch.empty(m)
                p2 = alg_cuda.two_phase_qsgd_owner(q, recv, world, m, ctx2, residual, res_out)
                assert p2 is not None
                assert_same_bits(p2[0], p2_ref[0], f"owner scales n={n} w={world}")
                assert_same_bits(p2[1], p2_ref[1], f"owner codes n={n} w={world}")
                assert_same_bits(res_out, res_ref, f"owner residual n={n} w={world}")
                if residual is not None:  # in place: residual_out aliasing residual_in
                    res = residual.clone()
                    p2b = alg_cuda.two_phase_qsgd_owner(q, recv, world, m, ctx2, res, res)
                    assert_same_bits(p2b[1], p2_ref[1], "owner codes (aliased residual)")
                    assert_same_bits(res, res_ref, "owner residual (aliased)")
    assert {name for name, *_ in be.launches} == {"two_phase_qsgd_owner"}


def test_two_phase_owner_shared_memory_limit_counts_static(emu):
    """The owner sum stays in registers: the block's shared memory is 8 B per rank (scale and
    step) plus the 144 B of static; world 6126 fits the 48 KiB exactly, 6127 does not, so
    dispatch declines (torch path) instead of a failing launch. A chunk that is not a multiple
    of 8 is declined too (the kernel encodes whole groups of 8 per chunk)."""
    be = emu()
    q = compressors.QSGD(bits=8, chunk=8)
    m = 8
    for world, fits in [(6127, False), (6126, True)]:
        recv = torch.zeros(world * (4 + m), dtype=torch.uint8)
        ctx2 = compressors.Context(numel=m, dtype=torch.float32)
        out = alg_cuda.two_phase_qsgd_owner(q, recv, world, m, ctx2)
        assert (out is not None) == fits, world
    assert [(n, s) for n, _, _, s in be.launches] == [("two_phase_qsgd_owner", 8 * 6126)]
    assert alg_cuda.two_phase_qsgd_owner(compressors.QSGD(bits=8, chunk=100), torch.zeros(2 * (4 + 100), dtype=torch.uint8),
                                         2, 100, compressors.Context(numel=100, dtype=torch.float32)) is None


def test_the_kernel_bench_runs_on_the_emulator(emu, capsys):
    """bench/kernels.py's code path (launch arguments, byte models, targets) on the CPU, so the
    one device run does not fail on a script error; timings here mean nothing."""
    import importlib.util
    import time
    from pathlib import Path

    def timer(fn, reps, warmup=0):
        t = time.perf_counter()
        fn()
        return max(1.0, (time.perf_counter() - t) * 1e6)

    emu(workers=2)
    path = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.run([20_000], 1, device="cpu", timer=timer)
    names = [r["kernel"] for r in rows]
    assert "qsgd quantize 8b" in names and "two-phase owner 8b w=8" in names and "shared-scale decode int8" in names
    assert all(r["roof_us"] and r["bytes_per_elt"] > 0 for r in rows)
    assert {r["target"].split()[0] for r in rows if r["target"]} == {">=60%copy", ">=40%copy", ">=2x", ">=30%copy"}
