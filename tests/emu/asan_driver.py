"""Run a subset of the emulator cases against an AddressSanitizer build (a subprocess: the
library needs libasan preloaded, see cuda_emu.asan_env). Usage::

    LD_PRELOAD=... python asan_driver.py LIB.so [all|pack-tail]

Exit 0 when every case matches its reference; ASan reports an out-of-bounds access with exit
code 66 (asan_env's ASAN_OPTIONS); a mismatch raises (exit 1)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.join(ROOT, "tests", "gpu"), ROOT]

import torch  # noqa: E402

import compressors  # noqa: E402
import cuda_emu  # noqa: E402
from compressors import bitpack  # noqa: E402
from compressors.cuda import dispatch, kernels  # noqa: E402
from comms.algorithms import cuda_kernels as alg_cuda
from gpu_helpers import assert_same_bits  # noqa: E402

__all__ = ["main"]


def _cpu_enabled_for(*ts):
    return bool(ts) and all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in ts)


def ctx_for(x):
    return compressors.Context(numel=x.numel(), dtype=x.dtype, device=x.device, step=3, bucket=1, rank=2, seed=7)


def main(lib_path, which="all"):
    dispatch.enabled_for = _cpu_enabled_for
    lib = cuda_emu.EmuLibrary(lib_path)
    for opts in ({}, {"grid": "few", "block": 32, "seed": 4}):
        kernels.set_backend(cuda_emu.EmuBackend(lib, guard=False, **opts))
        for n in (1, 33, 1000, 4099):
            g = torch.Generator().manual_seed(n)
            x = torch.randn(n, generator=g)
            for bits in (1, 2, 4, 8):
                codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
                got = kernels.pack(codes, bits)
                assert_same_bits(got, bitpack.pack(codes, bits), f"pack {n} {bits}")
                assert_same_bits(kernels.unpack(got, bits, n), codes, f"unpack {n} {bits}")
                if which != "all" or bits in (1, 4):
                    continue
                for chunk in (64, 33):
                    q = compressors.QSGD(bits=bits, chunk=chunk)
                    ref, p = q.compress(x, ctx_for(x)), dispatch.qsgd_compress(q, x, ctx_for(x))
                    assert_same_bits(p[1], ref[1], f"qsgd {n} {bits} {chunk}")
                    assert_same_bits(dispatch.qsgd_decompress(q, p, ctx_for(x)), q.decompress(ref, ctx_for(x)), "dec")
            if which != "all":
                continue
            s = compressors.ScaledSign(chunk=100)
            ref, p = s.compress(x, ctx_for(x)), dispatch.sign_compress(s, x, ctx_for(x))
            assert_same_bits(p[1], ref[1], "sign")
            assert_same_bits(dispatch.sign_decompress(s, p, ctx_for(x)), s.decompress(ref, ctx_for(x)), "sign dec")
            if n >= 1000:
                t = compressors.TopK(density=0.01, exact=False)
                ref, p = t.compress(x, ctx_for(x)), dispatch.topk_compress(t, x, ctx_for(x))
                assert_same_bits(p[1], ref[1], "topk idx")
                acc = torch.zeros(n)
                kernels.scatter_add_(acc, p[1], p[0])
                assert_same_bits(acc, torch.zeros(n).index_add_(0, ref[1].long(), ref[0]), "scatter")
            levels, scales = 63, compressors.qsgd.chunk_absmax(x, 100)
            q, own, step = alg_cuda.shared_scale_quantize(x, 100, scales, levels, torch.int8, 5, torch.float32)
            kernels.shared_scale_decode(q, 100, step, torch.float32)  # in bounds (checked by ASan)
            two_phase_case(n)
    print("ok")


def two_phase_case(n):
    import importlib
    from comms.algorithms.wire import to_bytes

    tp = importlib.import_module("comms.algorithms.two_phase")
    q = compressors.QSGD(bits=4, chunk=64)
    world = 3
    ctx = compressors.Context(numel=n * world, dtype=torch.float32, step=4, bucket=2, seed=11)
    payloads = [q.compress(torch.randn(n), tp.chunk_context(ctx, world, 1, 2, r)) for r in range(world)]
    recv = torch.cat([to_bytes(p) for p in payloads])
    ctx2 = tp.chunk_context(ctx, world, 2, 2, 2)
    res = torch.zeros(n)
    assert alg_cuda.two_phase_qsgd_owner(q, recv, world, n, ctx2, res, res) is not None


if __name__ == "__main__":
    main(*sys.argv[1:])
