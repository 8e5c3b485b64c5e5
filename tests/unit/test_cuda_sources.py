"""CPU checks of the CUDA side: sources documented and compilable, dispatch falls back cleanly.

The NVRTC / nvcc compile tests run where those tools exist (CuPy + an NVRTC library, or nvcc on
PATH) and skip otherwise; no GPU is needed to compile to PTX.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import compressors
from compressors.cuda import dispatch, loader
from comms.algorithms import cuda_kernels as alg_cuda

ROOT = Path(__file__).resolve().parents[2]
KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')


def _kernels_of(text):
    return KERNEL_RE.findall(text)


def _all_kernels():
    return sorted(k for f in loader.kernel_files() for k in _kernels_of((ROOT / "csrc" / f).read_text()))


@pytest.mark.parametrize("name", loader.kernel_files())
def test_each_cu_opens_with_a_comment_listing_its_kernels(name):
    text = (ROOT / "csrc" / name).read_text()
    assert text.startswith("//"), f"{name} must open with a comment"
    head_lines = []
    for line in text.splitlines():
        if not line.startswith("//"):
            break
        head_lines.append(line)
    head = "\n".join(head_lines)
    kernels = _kernels_of(text)
    assert kernels, f"{name} defines no kernel"
    for k in kernels:
        assert re.search(rf"\b{k}\(", head), f"{name}: kernel {k} not listed (with parameters) in the opening comment"


def test_dispatch_returns_none_for_cpu_tensors():
    x = torch.randn(5000)
    ctx = compressors.Context.of(x)
    q, s, t = compressors.QSGD(bits=4), compressors.ScaledSign(), compressors.TopK(exact=False)
    assert dispatch.qsgd_compress(q, x, ctx) is None
    p = q.compress(x, ctx)
    assert dispatch.qsgd_decompress(q, p, ctx) is None
    assert dispatch.qsgd_decompress_add_(q, p, ctx, torch.zeros(5000)) is None
    assert dispatch.sign_compress(s, x, ctx) is None
    assert dispatch.sign_decompress(s, s.compress(x, ctx), ctx) is None
    assert dispatch.topk_compress(t, x, ctx) is None
    assert dispatch.topk_decompress_add_(t, t.compress(x, ctx), ctx, torch.zeros(5000)) is None
    assert alg_cuda.shared_scale_quantize(x, 2048, torch.ones(3), 63, torch.int8, 1, torch.float32) is None
    assert alg_cuda.shared_scale_decode(torch.zeros(5000, dtype=torch.int8), 2048, torch.ones(3), torch.float32) is None
    assert alg_cuda.two_phase_qsgd_owner(q, torch.zeros(10, dtype=torch.uint8), 1, 5000, ctx) is None


def test_available_is_false_without_a_usable_cuda_device(monkeypatch):
    assert loader.available("cpu") is False
    assert loader.available(torch.device("cpu")) is False
    assert loader.available("not a device") is False
    monkeypatch.setenv("COMMPRESS_CUDA_KERNELS", "0")
    assert loader.available("cuda") is False
    if not torch.cuda.is_available():
        monkeypatch.delenv("COMMPRESS_CUDA_KERNELS")
        assert loader.available("cuda") is False


def test_cupy_is_not_imported_by_the_cpu_path():
    code = ("import sys, torch, compressors, comms, compressors.cuda.dispatch as d\n"
            "x = torch.randn(100); q = compressors.QSGD()\n"
            "assert d.qsgd_compress(q, x, compressors.Context.of(x)) is None\n"
            "assert 'cupy' not in sys.modules, 'cupy imported'\n")
    import sys
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return nvrtc
    except Exception:  # no CuPy, or no NVRTC library
        return None


@pytest.mark.timeout(120)
def test_nvrtc_compiles_every_kernel_without_fma():
    nvrtc = _nvrtc()
    if nvrtc is None:
        pytest.skip("CuPy with an NVRTC library not installed")
    prog = nvrtc.createProgram(loader.load_source(), "commpress.cu", (), ())
    try:
        nvrtc.compileProgram(prog, list(loader.NVRTC_OPTIONS) + ["-arch=compute_90"])
    except Exception as e:
        pytest.fail(f"NVRTC: {e}\n{nvrtc.getProgramLog(prog)}")
    ptx = nvrtc.getPTX(prog).decode()
    entries = sorted(re.findall(r"\.entry\s+(\w+)\(", ptx))
    assert entries == _all_kernels()
    assert not re.search(r"\bfma\.rn\.f32\b", ptx), "an fp32 FMA was contracted (bits would differ)"


@pytest.mark.timeout(300)
def test_nvcc_compiles_each_cu_file(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    for f in loader.kernel_files():
        r = subprocess.run([nvcc, "--ptx", "--fmad=false", "-std=c++17", "-arch=sm_90", "-include",
                            str(ROOT / "csrc" / "common.cuh"), str(ROOT / "csrc" / f), "-o", str(tmp_path / (f + ".ptx"))],
                           capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, f"{f}: {r.stderr[-2000:]}"
        ptx = (tmp_path / (f + ".ptx")).read_text()
        assert sorted(re.findall(r"\.entry\s+(\w+)\(", ptx)) == sorted(_kernels_of((ROOT / "csrc" / f).read_text()))
