"""The emulator sees kernel bugs: deliberately broken copies of csrc kernels must FAIL against
the reference (a missing __syncthreads, a shifted index), an out-of-bounds write must be
reported by the AddressSanitizer build, and the schedule shuffle must expose a race that the
in-order schedule hides. Plus the ASan run of the real kernels."""

import importlib
import re
import subprocess
import sys

import pytest
import torch

import compressors
import cuda_emu
from comms.algorithms.wire import to_bytes
from compressors import bitpack
from compressors.cuda import dispatch, kernels
from comms.algorithms import cuda_kernels as alg_cuda
from gpu_helpers import assert_same_bits

tp = importlib.import_module("comms.algorithms.two_phase")


def altered(file, old, new, count=1):
    """csrc sources with ``old`` replaced by ``new`` in ``file`` (which must contain it)."""
    out = []
    for name, text in cuda_emu.csrc_sources():
        if name == file:
            assert text.count(old) >= count, f"{file} no longer contains {old!r}: update this test"
            text = text.replace(old, new, count)
        out.append((name, text))
    return out


def owner_case(world=4, m=3000, bits=4, chunk=1024):
    q = compressors.QSGD(bits=bits, chunk=chunk)
    ctx = compressors.Context(numel=m * world, dtype=torch.float32, step=4, bucket=2, seed=11)
    g = torch.Generator().manual_seed(0)
    payloads = [q.compress(torch.randn(m, generator=g), tp.chunk_context(ctx, world, 1, world - 1, r))
                for r in range(world)]
    recv = torch.cat([to_bytes(p) for p in payloads])
    ctx2 = tp.chunk_context(ctx, world, 2, world - 1, world - 1)
    return q, recv, world, m, ctx2


def run_owner(emu, lib, **opts):
    emu(lib=lib, **opts)
    q, recv, world, m, ctx2 = owner_case()
    res = torch.empty(m)
    p2 = alg_cuda.two_phase_qsgd_owner(q, recv, world, m, ctx2, None, res)
    return p2, res


def test_real_two_phase_kernel_passes_every_schedule(emu, emu_lib):
    ref = run_owner(emu, emu_lib)
    for seed in (1, 2, 3):
        got = run_owner(emu, emu_lib, seed=seed, grid="few")
        for a, b in zip(got[0] + [got[1]], ref[0] + [ref[1]]):
            assert_same_bits(a, b, f"seed {seed}")


def test_missing_syncthreads_in_two_phase_is_caught(emu, emu_lib, emu_build):
    # the barrier that publishes the senders' scales (s_r, w_r) before the decode reads them
    broken = cuda_emu.EmuLibrary(emu_build(altered(
        "two_phase.cu", "            w_r[r] = qsgd_step(s, M);\n        }\n        __syncthreads();",
        "            w_r[r] = qsgd_step(s, M);\n        }\n")))
    ref = run_owner(emu, emu_lib)
    got = run_owner(emu, broken)
    assert not torch.equal(got[0][1], ref[0][1]) or not torch.equal(got[1], ref[1]), \
        "the emulator did not see the missing __syncthreads"


def test_missing_syncthreads_in_block_reduce_is_caught(emu, emu_lib, emu_build):
    # the first barrier of block_reduce_max_nan (warp maxima published before warp 0 reads them)
    text = dict(cuda_emu.csrc_sources())["common.cuh"]
    assert "    if (lane == 0) warp_max[wid] = v;\n    __syncthreads();" in text
    broken = cuda_emu.EmuLibrary(emu_build(altered(
        "common.cuh", "    if (lane == 0) warp_max[wid] = v;\n    __syncthreads();",
        "    if (lane == 0) warp_max[wid] = v;")))
    x = torch.randn(20_000)
    x[5000] = 1e6  # the max of its chunk sits in a warp other than warp 0
    emu(lib=emu_lib)
    ref = kernels.chunk_absmax(x, 4096)
    emu(lib=broken)
    got = kernels.chunk_absmax(x, 4096)
    assert not torch.equal(got, ref), "the emulator did not see the missing __syncthreads"


def test_shifted_pack_index_is_caught(emu, emu_build):
    broken = cuda_emu.EmuLibrary(emu_build(altered(
        "pack.cu", "out |= ((in >> (8 * k)) & mask) << (k * bits);",
        "out |= ((in >> (8 * k)) & mask) << (((k + 1) & 7) * bits);")))
    emu(lib=broken)
    codes = torch.randint(0, 4, (1000,), dtype=torch.uint8)
    assert not torch.equal(kernels.pack(codes, 2), bitpack.pack(codes, 2))


# -- the schedule shuffle finds a race the in-order schedule hides ---------------------------
RACE_CU = r'''// race.cu -- test kernels for the emulator.
// Kernels:
//   racy_broadcast(float* out, int sync)   thread 0 stores a shared value every thread reads
//   shfl_after_exit(float* out)            half a warp exits before a full-mask shuffle
extern "C" __global__ void racy_broadcast(float* out, int sync) {
    __shared__ float v;
    if (threadIdx.x == 0) v = 1.0f + blockIdx.x;
    if (sync) __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

extern "C" __global__ void shfl_after_exit(float* out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffU, 1.0f, 1);
}
'''


@pytest.fixture(scope="module")
def race_lib(emu_build):
    common = dict(cuda_emu.csrc_sources())["common.cuh"]
    return cuda_emu.EmuLibrary(emu_build([("common.cuh", common), ("race.cu", RACE_CU)]))


def test_shuffled_schedule_exposes_a_missing_barrier(race_lib):
    import numpy as np

    def run(seed, sync):
        out = torch.zeros(4 * 64)
        race_lib.launch("racy_broadcast", 4, 64, 0, (out, np.int32(sync)), seed=seed)
        return out

    want = torch.arange(1, 5, dtype=torch.float32).repeat_interleave(64)
    assert torch.equal(run(0, 0), want)  # in order, thread 0 happens to store first
    assert all(torch.equal(run(s, 1), want) for s in range(1, 6))  # with the barrier: always right
    assert any(not torch.equal(run(s, 0), want) for s in range(1, 6)), "no shuffled schedule showed the race"


def test_shuffle_with_an_exited_lane_is_an_error_not_a_hang(race_lib):
    with pytest.raises(cuda_emu.EmuError, match="exited"):
        race_lib.launch("shfl_after_exit", 1, 32, 0, (torch.zeros(32),))


def test_launcher_checks_argument_types(race_lib):
    import numpy as np

    with pytest.raises(cuda_emu.EmuError, match="kind 'i' of 4 bytes"):
        race_lib.launch("racy_broadcast", 1, 32, 0, (torch.zeros(32), np.int64(1)))
    with pytest.raises(cuda_emu.EmuError, match="2 arguments for 1"):
        race_lib.launch("shfl_after_exit", 1, 32, 0, (torch.zeros(32), None))


# -- AddressSanitizer --------------------------------------------------------------------------
def _asan(emu_build, sources, which):
    lib = emu_build(sources, asan=True)
    env = cuda_emu.asan_env()
    return subprocess.run([sys.executable, str(cuda_emu.HERE / "asan_driver.py"), str(lib), which],
                          env=env, capture_output=True, text=True, timeout=240)


def test_asan_run_of_the_real_kernels(emu_build):
    r = _asan(emu_build, None, "all")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


def test_asan_sees_an_out_of_bounds_tail_write(emu_build):
    # the tail of the packed stream is written bytewise up to nbytes; one byte too far
    r = _asan(emu_build, altered("common.cuh", "for (int b = 0; b < bits && off + b < nbytes; ++b) packed[off + b]",
                                 "for (int b = 0; b < bits && off + b <= nbytes; ++b) packed[off + b]"), "pack-tail")
    assert r.returncode == 66 and "AddressSanitizer" in r.stderr and "WRITE of size 1" in r.stderr, \
        r.stdout[-2000:] + r.stderr[-4000:]


def test_asan_sees_the_topk_capacity_overflow(emu_build):
    # slot == cap written one past the candidate buffer (torch's own allocation: a heap redzone)
    r = _asan(emu_build, altered("topk.cu", "if (slot < cap) cand[slot]", "if (slot <= cap) cand[slot]"), "all")
    assert r.returncode == 66 and "heap-buffer-overflow" in r.stderr and "WRITE of size 4" in r.stderr, \
        r.stdout[-2000:] + r.stderr[-4000:]
