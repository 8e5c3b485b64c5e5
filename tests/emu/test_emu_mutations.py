"""Mutation tests: a bug planted in a COPY of the csrc sources must make a check fail -- an
assertion against the torch reference or an emulator error, never a crash of the pytest
process -- while the real sources pass the same check.

The planted bugs are the kinds a first emulator missed: an atomic reservation made a plain
read-then-write (a lost update that only an interleaved schedule shows), a capacity check off
by one (a write one past a buffer: the canary guard of the launch arguments turns it into an
error), a read of uninitialised static __shared__ memory (garbage-filled per block), the fp16
conversion's rounding mode (the device branch is the one emulated), and a vector store taken
without checking the pointer's alignment (an error on a GPU, silent on x86)."""

import numpy as np
import pytest
import torch

import compressors
import cuda_emu
from comms.algorithms import cuda_kernels as alg_cuda
from comms.algorithms.shared_scale import _STREAM_SALT, _per_chunk_, quantize_reference, shared_scale_levels
from compressors.cuda import dispatch, kernels
from compressors.hashrng import stream_key
from compressors.qsgd import chunk_absmax
from gpu_helpers import assert_same_bits, assert_same_bits_nan

# an interleaved schedule: scheduling points at memory accesses, three blocks at once
INTERLEAVED = [{"seed": s, "interleave": 0.5, "resident": 3} for s in (13, 14)]


def make_x(n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + n)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))).to(dtype)


def ctx_for(x):
    return compressors.Context(numel=x.numel(), dtype=x.dtype, step=3, bucket=1, rank=2, seed=7)


def misaligned(t):
    """A copy of ``t`` whose data pointer is 4 bytes past a 16-byte boundary."""
    buf = torch.empty(t.numel() + 16, dtype=t.dtype)
    k = (4 - buf.data_ptr() % 16) % 16 // t.element_size()
    out = buf[k:k + t.numel()]
    out.copy_(t)
    assert out.data_ptr() % 16 == 4
    return out


# -- checks: each passes with the real sources -------------------------------------------------
def check_topk_compact(emu, lib):
    x = make_x(65543)
    thr = x.abs().median()
    want = torch.nonzero(x.abs() >= thr).flatten().to(torch.int32)
    for opts in [{}] + INTERLEAVED:
        emu(lib=lib, **opts)
        for cap in (want.numel() + 3, want.numel() // 3):
            slots, count = kernels.topk_compact(x, thr, cap)
            assert int(count) == want.numel(), f"count {int(count)} != {want.numel()} ({opts})"
            written = slots[:min(cap, want.numel())]
            if cap >= want.numel():
                assert_same_bits(torch.sort(written).values, want, f"slots {opts}")
            else:
                assert written.unique().numel() == written.numel() and bool(torch.isin(written, want).all())


def check_chunk_absmax(emu, lib):
    x = make_x(20_000)
    for opts in ({}, {"seed": 3}):
        emu(lib=lib, **opts)
        for chunk in (4096, 1000):
            assert_same_bits_nan(kernels.chunk_absmax(x, chunk), chunk_absmax(x, chunk), f"chunk {chunk} {opts}")


def check_fp16_outputs(emu, lib):
    emu(lib=lib)
    x = make_x(5000, torch.float16)
    q = compressors.QSGD(bits=4, chunk=256)
    ref = q.compress(x, ctx_for(x))
    assert_same_bits(dispatch.qsgd_decompress(q, ref, ctx_for(x)), q.decompress(ref, ctx_for(x)), "qsgd fp16 decode")
    levels, wire = shared_scale_levels(8, 2)
    xf = x.float()
    scales = chunk_absmax(xf, 512) * 1.5
    key = stream_key(7, 3, 1 ^ _STREAM_SALT, 2)
    _, t, step = quantize_reference(xf, 512, scales, levels, wire, key)
    _, own, _ = alg_cuda.shared_scale_quantize(xf, 512, scales, levels, wire, key, torch.float16)
    assert_same_bits(own, _per_chunk_(t.clone(), step, 512, "mul_").to(torch.float16), "own fp16")


def check_misaligned_views(emu, lib):
    """Every vectorised kernel on views that are 4 bytes off a 16-byte boundary (the
    element-wise path) gives the reference's bits."""
    emu(lib=lib)
    for dtype in (torch.float32, torch.bfloat16):
        x = misaligned(make_x(3001, dtype))
        for bits in (1, 8):
            q = compressors.QSGD(bits=bits, chunk=512)
            ref = q.compress(x, ctx_for(x))
            got = dispatch.qsgd_compress(q, x, ctx_for(x))
            assert_same_bits(got[1], ref[1], f"codes {dtype} {bits}")
            dref = q.decompress(ref, ctx_for(x))
            wire = [ref[0], misaligned(ref[1].view(torch.uint8)) if bits == 8 else ref[1]]
            out = misaligned(torch.zeros(x.numel(), dtype=dtype))
            assert dispatch.qsgd_decompress(q, wire, ctx_for(x), out) is out
            assert_same_bits(out, dref, f"decode into a misaligned out {dtype} {bits}")
        s = compressors.ScaledSign(chunk=128)
        ref = s.compress(x, ctx_for(x))
        got = dispatch.sign_compress(s, x, ctx_for(x))
        assert_same_bits(got[1], ref[1], f"sign bits {dtype}")
        out = misaligned(torch.zeros(x.numel(), dtype=dtype))
        dispatch.sign_decompress(s, got, ctx_for(x), out)
        assert_same_bits(out, s.decompress(ref, ctx_for(x)), f"sign decode {dtype}")


# -- the planted bugs ----------------------------------------------------------------------------
MUTATIONS = [
    ("topk-lost-update", "topk.cu", "tile_base = atomicAdd(count, winc);",
     "{ u32 seen = *count; *count = seen + winc; tile_base = seen; }", check_topk_compact),
    ("topk-capacity-overflow", "topk.cu", "if (slot < cap) cand[slot] = (int)(i + k);",
     "if (slot <= cap) cand[slot] = (int)(i + k);", check_topk_compact),
    ("uninitialised-static-shared", "common.cuh", "v = lane < nw ? warp_max[lane] : 0.0f;",
     "v = warp_max[lane];", check_chunk_absmax),
    ("fp16-round-toward-zero", "common.cuh", 'asm("cvt.rn.f16.f32 %0, %1;"', 'asm("cvt.rz.f16.f32 %0, %1;"',
     check_fp16_outputs),
    ("unchecked-alignment-store", "quantize.cu", "ovec = aligned_to(out, 16);", "ovec = true;",
     check_misaligned_views),
]
IDS = [m[0] for m in MUTATIONS]


def mutated(file, old, new):
    out = []
    for name, text in cuda_emu.csrc_sources():
        if name == file:
            assert text.count(old) == 1, f"{file} no longer contains {old!r} once: update this mutation"
            text = text.replace(old, new)
        out.append((name, text))
    return out


@pytest.mark.parametrize("mid", IDS)
def test_the_real_sources_pass_the_check(emu, emu_lib, mid):
    check = dict((m[0], m[4]) for m in MUTATIONS)[mid]
    check(emu, emu_lib)


@pytest.mark.parametrize("mid", IDS)
def test_a_planted_bug_fails_the_check(emu, emu_build, mid):
    _, file, old, new, check = dict((m[0], m) for m in MUTATIONS)[mid]
    lib = cuda_emu.EmuLibrary(emu_build(mutated(file, old, new)))
    with pytest.raises((AssertionError, cuda_emu.EmuError)) as info:
        check(emu, lib)
    print(f"{mid}: {info.typename}: {str(info.value).splitlines()[0][:200]}")
