"""The emulator's own model, on small test kernels: the PTX conversions it emulates agree with
IEEE (torch's CPU conversions), a lost update and a cross-block race show under an interleaved
schedule, misaligned scalar and vector accesses are errors, static __shared__ is per block and
uninitialised (garbage, nothing left over from another block or launch), and AddressSanitizer
sees a static __shared__ array read past its end."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import cuda_emu

MODEL_CU = r'''// model.cu -- test kernels for the emulator's execution model.
extern "C" __global__ void cvt_to_half(const float* x, u16* rn, u16* rz, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        rn[i] = f32_to_half_bits(x[i]);
        u16 h;
        asm("cvt.rz.f16.f32 %0, %1;" : "=h"(h) : "f"(x[i]));
        rz[i] = h;
    }
}

extern "C" __global__ void cvt_from_half(const u16* h, float* out, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = half_bits_to_f32(h[i]);
}

// every thread (atomic = 0: a plain read-then-write, a lost update) adds 1 to *count
extern "C" __global__ void count_up(u32* count, int atomic) {
    if (atomic) {
        atomicAdd(count, 1U);
    } else {
        u32 v = *count;
        *count = v + 1U;
    }
}

// thread 0 of every block: a plain read-then-write of one global counter (a cross-block race)
extern "C" __global__ void count_blocks(u32* count) {
    if (threadIdx.x == 0) {
        u32 v = *count;
        *count = v + 1U;
    }
}

extern "C" __global__ void store_u32_at(u8* p, i64 offset, u32 v) {
    if (threadIdx.x == 0) *reinterpret_cast<u32*>(p + offset) = v;
}

extern "C" __global__ void load_vec_at(const u8* p, i64 offset, u32* out) {
    if (threadIdx.x == 0) {
        vec4u a = *reinterpret_cast<const vec4u*>(p + offset);
        out[0] = a.x ^ a.y ^ a.z ^ a.w;
    }
}

// write = 1: every thread stores its index into a static __shared__ slot; then (after a
// barrier) every thread copies the slots out -- with write = 0, uninitialised memory
extern "C" __global__ void shared_roundtrip(u32* out, int write, int past_end) {
    __shared__ u32 slots[64];
    if (write && threadIdx.x < 64) slots[threadIdx.x] = threadIdx.x + 1000U * blockIdx.x;
    __syncthreads();
    if (threadIdx.x < 64) out[blockIdx.x * 64 + threadIdx.x] = slots[threadIdx.x + (past_end ? 64 : 0)];
}
'''


@pytest.fixture(scope="module")
def model_lib(emu_build):
    common = dict(cuda_emu.csrc_sources())["common.cuh"]
    return cuda_emu.EmuLibrary(emu_build([("common.cuh", common), ("model.cu", MODEL_CU)]))


def _halves_of(x, lib, block=256):
    n = x.numel()
    rn, rz = torch.empty(n, dtype=torch.int16), torch.empty(n, dtype=torch.int16)
    lib.launch("cvt_to_half", 64, block, 0, (x, rn, rz, np.int64(n)))
    return rn, rz


def test_ptx_f32_to_f16_rounds_to_nearest_even_like_torch(model_lib):
    g = torch.Generator().manual_seed(0)
    # every finite half and the midpoints between neighbours (exact in fp32), +-1 ulp around them
    h = torch.arange(0, 0x7C00, dtype=torch.int32)
    vals = h.to(torch.int16).view(torch.float16).float()
    mids = (vals[:-1].double() + vals[1:].double()) / 2
    mid32 = mids.float()
    bits = mid32.view(torch.int32)
    rand = torch.randint(-2**31, 2**31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([vals, mid32, (bits + 1).view(torch.float32), (bits - 1).view(torch.float32), rand,
                   torch.tensor([65504.0, 65519.99, 65520.0, 1e9, float("inf"), 2.0**-25, 2.0**-26, 1e-45])])
    x = torch.cat([x, -x])
    x = x[~torch.isnan(x)].contiguous()
    rn, rz = _halves_of(x, model_lib)
    want = x.to(torch.float16).view(torch.int16)
    bad = (rn != want).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ, e.g. x={x[bad[:4]].tolist()}: {rn[bad[:4]].tolist()} vs {want[bad[:4]].tolist()}"
    # toward zero: never larger in magnitude than x, and the next half up is
    zr = rz.view(torch.float16).float()
    fin = torch.isfinite(x)
    assert bool((zr[fin].abs() <= x[fin].abs()).all())
    assert bool((zr != rn.view(torch.float16).float()).any())  # rz is a different rounding
    nan_h = _halves_of(torch.tensor([float("nan"), -float("nan")]), model_lib)[0]
    assert nan_h.tolist() == [0x7FFF, 0x7FFF]


def test_ptx_f16_to_f32_is_exact_for_every_half(model_lib):
    h = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    out = torch.empty(h.numel())
    model_lib.launch("cvt_from_half", 64, 256, 0, (h, out, np.int64(h.numel())))
    want = h.view(torch.float16).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))


def _count(lib, name, grid, block, args, **kw):
    c = torch.zeros(1, dtype=torch.int32)
    lib.launch(name, grid, block, 0, (c,) + args, **kw)
    return int(c)


def test_interleaving_shows_a_lost_update(model_lib):
    # fibers switch only at synchronisation points without interleave: the plain update "works"
    assert _count(model_lib, "count_up", 2, 256, (np.int32(0),)) == 512
    assert _count(model_lib, "count_up", 2, 256, (np.int32(0),), seed=3) == 512
    lost = _count(model_lib, "count_up", 2, 256, (np.int32(0),), seed=3, interleave=0.5)
    assert lost < 512, "the interleaved schedule did not show the lost update"
    assert _count(model_lib, "count_up", 2, 256, (np.int32(1),), seed=3, interleave=0.5) == 512


def test_resident_blocks_show_a_cross_block_race(model_lib):
    assert _count(model_lib, "count_blocks", 16, 32, ()) == 16
    raced = _count(model_lib, "count_blocks", 16, 32, (), seed=5, interleave=0.5, resident=4)
    assert raced < 16, "interleaved resident blocks did not show the race between blocks"


def test_misaligned_scalar_store_is_an_error(model_lib):
    buf = torch.zeros(64, dtype=torch.uint8)
    model_lib.launch("store_u32_at", 1, 32, 0, (buf, np.int64(8), np.uint32(7)))
    assert int(buf[8]) == 7
    with pytest.raises(cuda_emu.EmuError, match="misaligned 4-byte store"):
        model_lib.launch("store_u32_at", 1, 32, 0, (buf, np.int64(6), np.uint32(7)))


def test_misaligned_vector_load_is_an_error(model_lib):
    buf = torch.arange(64, dtype=torch.uint8)
    out = torch.zeros(1, dtype=torch.int32)
    model_lib.launch("load_vec_at", 1, 32, 0, (buf, np.int64(16), out))
    with pytest.raises(cuda_emu.EmuError, match="misaligned 16-byte load"):
        model_lib.launch("load_vec_at", 1, 32, 0, (buf, np.int64(4), out))  # 4-byte aligned only


def test_static_shared_is_per_block_and_uninitialised(model_lib):
    out = torch.zeros(4 * 64, dtype=torch.int32)
    model_lib.launch("shared_roundtrip", 4, 64, 0, (out, np.int32(1), np.int32(0)), resident=2, seed=2)
    want = (torch.arange(64) + 1000 * torch.arange(4)[:, None]).flatten().to(torch.int32)
    assert torch.equal(out, want)
    # no write: garbage (0xFF bytes in order; random with a seed), not the last block's values
    model_lib.launch("shared_roundtrip", 4, 64, 0, (out, np.int32(0), np.int32(0)))
    assert bool((out == -1).all())
    model_lib.launch("shared_roundtrip", 4, 64, 0, (out, np.int32(0), np.int32(0)), seed=9)
    assert not bool(torch.isin(out, want).any())


def test_asan_sees_a_static_shared_read_past_the_end(emu_build):
    common = dict(cuda_emu.csrc_sources())["common.cuh"]
    lib = emu_build([("common.cuh", common), ("model.cu", MODEL_CU)], asan=True)
    code = ("import sys, numpy as np, torch; sys.path.insert(0, %r); import cuda_emu;"
            "lib = cuda_emu.EmuLibrary(%r); out = torch.zeros(64, dtype=torch.int32);"
            "lib.launch('shared_roundtrip', 1, 64, 0, (out, np.int32(1), np.int32(%d)), guard=False); print('ran')")
    ok = subprocess.run([sys.executable, "-c", code % (str(cuda_emu.HERE), str(lib), 0)], env=cuda_emu.asan_env(),
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "ran" in ok.stdout, ok.stderr[-3000:]
    bad = subprocess.run([sys.executable, "-c", code % (str(cuda_emu.HERE), str(lib), 1)], env=cuda_emu.asan_env(),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 66 and "AddressSanitizer" in bad.stderr and "READ of size 4" in bad.stderr, \
        bad.stdout[-1000:] + bad.stderr[-3000:]
