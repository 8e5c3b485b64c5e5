"""Run every csrc entry point against an AddressSanitizer build of the emulator (a subprocess:
the library needs libasan preloaded, see cuda_emu.asan_env). Usage::

    LD_PRELOAD=... python asan_driver.py LIB.so [all|pack-tail]

``all``: every kernel, every input dtype, sizes with partial tails (1, 7, 33, 1000, 4099),
views that end exactly at their allocation's end and start 4 bytes off a 16-byte boundary
(the element-wise paths), top-k capacities below, at and above the candidate count, and a
final check that every kernel of the sources was launched. Launch arguments are NOT copied
between canaries here (guard=False): the kernels touch torch's own allocations, whose heap
redzones ASan watches. Exit 0 when every case matches its reference; ASan reports an
out-of-bounds access with exit code 66 (asan_env's ASAN_OPTIONS); a mismatch raises (exit 1)."""

import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.join(ROOT, "tests", "gpu"), ROOT]

import torch  # noqa: E402

import compressors  # noqa: E402
import cuda_emu  # noqa: E402
from comms.algorithms import cuda_kernels as alg_cuda  # noqa: E402
from comms.algorithms.wire import to_bytes  # noqa: E402
from compressors import bitpack  # noqa: E402
from compressors.cuda import dispatch, kernels  # noqa: E402
from gpu_helpers import assert_same_bits, assert_same_bits_nan  # noqa: E402

__all__ = ["main"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SIZES = (1, 7, 33, 1000, 4099)


def _cpu_enabled_for(*ts):
    return bool(ts) and all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in ts)


def ctx_for(x):
    return compressors.Context(numel=x.numel(), dtype=x.dtype, device=x.device, step=3, bucket=1, rank=2, seed=7)


def end_view(t, shift=4):
    """A copy of ``t`` that ends exactly where its allocation ends and starts ``shift`` bytes
    past the allocation's (64-byte aligned) start: a read or write past it is out of bounds."""
    k = shift // t.element_size()
    buf = torch.empty(t.numel() + k, dtype=t.dtype)
    out = buf[k:]
    out.copy_(t.reshape(-1))
    return out


def make_x(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + n)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).to(dtype)


def qsgd_cases(x):
    for bits in (1, 2, 4, 8):
        for chunk in (256, 100, 33):  # encode_chunks; quantize_fused (bits 8); absmax + packed
            q = compressors.QSGD(bits=bits, chunk=chunk)
            ref, got = q.compress(x, ctx_for(x)), dispatch.qsgd_compress(q, x, ctx_for(x))
            assert_same_bits(got[1], ref[1], f"qsgd codes {x.dtype} n={x.numel()} {bits} {chunk}")
            dref = q.decompress(ref, ctx_for(x))
            assert_same_bits(dispatch.qsgd_decompress(q, got, ctx_for(x)), dref, "qsgd decode")
            wire = [end_view(got[0]), end_view(got[1], shift=1)]  # payload views off alignment
            assert_same_bits(dispatch.qsgd_decompress(q, wire, ctx_for(x), end_view(torch.empty_like(x))), dref,
                             "qsgd decode (views)")
            if x.dtype == torch.float32:
                acc = end_view(torch.ones(x.numel()))
                dispatch.qsgd_decompress_add_(q, got, ctx_for(x), acc)
                assert_same_bits(acc, torch.ones(x.numel()).add_(dref), "qsgd decode-add")


def sign_cases(x):
    s = compressors.ScaledSign(chunk=100)
    ref = s.compress(x, ctx_for(x))
    for xin in (x, end_view(x)):  # vector path, ballot path
        got = dispatch.sign_compress(s, xin, ctx_for(xin))
        assert_same_bits(got[1], ref[1], f"sign bits {x.dtype} n={x.numel()}")
    dref = s.decompress(ref, ctx_for(x))
    assert_same_bits(dispatch.sign_decompress(s, got, ctx_for(x)), dref, "sign decode")
    assert_same_bits(dispatch.sign_decompress(s, got, ctx_for(x), end_view(torch.empty_like(x))), dref, "into view")
    if x.dtype == torch.float32:
        acc = end_view(torch.ones(x.numel()))
        dispatch.sign_decompress_add_(s, got, ctx_for(x), acc)
        assert_same_bits(acc, torch.ones(x.numel()).add_(dref), "sign decode-add")


def topk_cases(x):
    n = x.numel()
    thr = x.abs().float().median().to(x.dtype)
    want = torch.nonzero(x.abs() >= thr).flatten().to(torch.int32)
    for cap in (1, max(1, want.numel() - 1), want.numel(), want.numel() + 5):
        slots, count = kernels.topk_compact(end_view(x), thr, cap)
        assert int(count) == want.numel(), "topk count"
        if cap >= want.numel():
            assert_same_bits(torch.sort(slots[:want.numel()]).values, want, "topk slots")
    if n >= 1000:
        t = compressors.TopK(density=0.01, exact=False)
        ref, got = t.compress(x, ctx_for(x)), dispatch.topk_compress(t, x, ctx_for(x))
        assert_same_bits(got[1], ref[1], "topk idx")
        acc = torch.zeros(n)
        kernels.scatter_add_(acc, got[1], got[0])
        assert_same_bits(acc, torch.zeros(n).index_add_(0, ref[1].long(), ref[0].float()), "scatter")
    idx = torch.tensor([0, n - 1, n, -1, 0], dtype=torch.int32)  # pads, last element, out of range
    vals = torch.ones(5, dtype=x.dtype)
    ok = (idx >= 0) & (idx < n)
    acc = kernels.scatter_add_(torch.zeros(n), idx, vals)
    assert_same_bits(acc, torch.zeros(n).index_add_(0, idx[ok].long(), vals[ok].float()), "scatter, out of range")


def shared_scale_cases(x):
    xf = x.float()
    scales = compressors.qsgd.chunk_absmax(xf, 100)
    for wire in (torch.int8, torch.int32):
        for own_dtype in (None,) + DTYPES:
            q, own, step = alg_cuda.shared_scale_quantize(end_view(xf), 100, scales, 63, wire, 5, own_dtype)
            for dtype in DTYPES:
                kernels.shared_scale_decode(end_view(q), 100, step, dtype)
                kernels.shared_scale_decode(q, 100, step, dtype)


def two_phase_cases(n):
    tp = importlib.import_module("comms.algorithms.two_phase")
    for bits, chunk, world in ((4, 64, 3), (1, 2048, 1), (8, 104, 2)):
        q = compressors.QSGD(bits=bits, chunk=chunk)
        ctx = compressors.Context(numel=n * world, dtype=torch.float32, step=4, bucket=2, seed=11)
        payloads = [q.compress(make_x(n, torch.float32, r), tp.chunk_context(ctx, world, 1, world - 1, r))
                    for r in range(world)]
        recv = torch.cat([to_bytes(p) for p in payloads])
        ctx2 = tp.chunk_context(ctx, world, 2, world - 1, world - 1)
        res = end_view(make_x(n, torch.float32, 9) * 1e-3)
        assert alg_cuda.two_phase_qsgd_owner(q, recv, world, n, ctx2, res, res) is not None
        assert alg_cuda.two_phase_qsgd_owner(q, recv, world, n, ctx2) is not None


def pack_cases(n, g, which):
    for bits in (1, 2, 4, 8):
        codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
        got = kernels.pack(codes, bits)
        assert_same_bits(got, bitpack.pack(codes, bits), f"pack {n} {bits}")
        assert_same_bits(kernels.unpack(got, bits, n), codes, f"unpack {n} {bits}")


def main(lib_path, which="all"):
    dispatch.enabled_for = _cpu_enabled_for
    lib = cuda_emu.EmuLibrary(lib_path)
    launched = set()
    for opts in ({}, {"grid": "few", "block": 32, "seed": 4}):
        be = cuda_emu.EmuBackend(lib, guard=False, **opts)
        kernels.set_backend(be)
        for n in SIZES:
            g = torch.Generator().manual_seed(n)
            pack_cases(n, g, which)
            if which != "all":
                continue
            for dtype in DTYPES:
                x = make_x(n, dtype)
                qsgd_cases(x)
                sign_cases(x)
                topk_cases(x)
                shared_scale_cases(x)
                assert_same_bits_nan(kernels.chunk_absmax(end_view(x), 33), compressors.qsgd.chunk_absmax(x, 33), "absmax")
            two_phase_cases(n)
        launched |= {name for name, *_ in be.launches}
    if which == "all":
        every = {k for _, text in cuda_emu.csrc_sources() for k in cuda_emu.kernel_names(text)}
        assert launched == every, f"entry points the ASan run did not launch: {sorted(every - launched)}"
    print("ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
