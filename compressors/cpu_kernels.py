"""The CPU codec kernels of ``csrc/cpu/codec.cpp``: built with g++ on first use, loaded with ctypes.

One plain C++ file (no torch headers), compiled into a shared library in a per-user cache
folder keyed by the hash of the source, the flags and the CPU's feature flags
(``-march=native``): ``$COMMPRESS_CACHE_DIR``, else ``$XDG_CACHE_HOME/commpress``, else
``~/.cache/commpress``. A cached library loads without a compiler (the key runs nothing), so a
machine or container that shares the cache needs no g++. The compiler's version is not part
of the key: every kernel must give its torch twin's bits whatever compiled it (``-ffp-contract=off``,
no fast-math), and the library's ABI number is checked at load. A wheel carries the source as
``compressors/_csrc/cpu/codec.cpp``.

Every kernel has a torch/numpy twin in the compressor that calls it (the fallback, and the
test oracle): both give the same bits, for every thread count. :func:`lib` returns None and
the compressors take the torch/numpy path when there is no compiler and no cached build, the
build fails, the tensor is not a CPU tensor, or ``COMMPRESS_CPU_KERNELS=0`` (read at every
call, so tests can flip it). A failed load or build warns once per process
(:class:`CodecFallbackWarning`, naming the reason and the cost: the torch path encodes exact
top-k about 30x slower, 31 against 1.0 ns per element); switching the kernels off does not warn. Kernels use ``torch.get_num_threads()`` threads
(each on disjoint, chunk-aligned element ranges; results never depend on the count). ctypes
releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["ENV_SWITCH", "FLAGS", "ABI_VERSION", "CodecFallbackWarning", "lib", "enabled", "threads",
           "source_path", "cache_key", "library_path", "ptr", "dtype_code", "SUM_LANES", "build_error"]

logger = logging.getLogger(__name__)

# fp32 vector widths the compiled row sums can follow, most common first. torch's sum ran at 8
# lanes on AVX2 and also on an AVX-512 Xeon (torch 2.13, capability "AVX512"), so the width is
# measured, not read from the capability: callers keep the one that reproduces torch's bits.
SUM_LANES = (8, 16)

ENV_SWITCH = "COMMPRESS_CPU_KERNELS"
#: -ffp-contract=off: no multiply-add is fused (bits must equal the torch path's)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math",
         "-fno-trapping-math", "-std=c++17",
         "-shared", "-fPIC", "-pthread", "-fvisibility=hidden")

#: the ``cp_abi_version()`` this module's declarations match (a stale build is rebuilt)
ABI_VERSION = 8

_lock = threading.Lock()
_state: dict = {}  # "lib": CDLL or None once tried; "error": why not


def source_path() -> Path:
    from .cuda.loader import source_root  # the csrc folder (installed: compressors/_csrc)
    return Path(source_root()) / "cpu" / "codec.cpp"


def _cache_dir() -> Path:
    d = os.environ.get("COMMPRESS_CACHE_DIR")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "commpress"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform
    return platform.processor() + platform.machine()


class CodecFallbackWarning(RuntimeWarning):
    """The compiled CPU codecs could not be loaded; the torch path runs instead (same bits, slower)."""


def cache_key() -> str:
    """The cache key of the compiled library: source, flags and CPU features (runs no program)."""
    h = hashlib.sha256(source_path().read_bytes() + repr(FLAGS).encode() + _cpu_flags().encode())
    return h.hexdigest()[:20]


def library_path() -> Path:
    """Where the compiled library for this source, these flags and this CPU is cached."""
    return _cache_dir() / f"codec-{cache_key()}.so"


def _compile(so: Path) -> None:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError(f"no C++ compiler (g++) on PATH and no cached build at {so}")
    so.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *FLAGS, "-o", tmp, str(source_path())],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {r.stderr[-2000:]}")
        os.replace(tmp, so)  # atomic: concurrent builders (ranks) all end with a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(so: Path) -> ctypes.CDLL:
    cdll = ctypes.CDLL(str(so))
    _declare(cdll)
    if cdll.cp_abi_version() != ABI_VERSION:
        raise RuntimeError(f"stale codec library {so} (ABI {cdll.cp_abi_version()}, need {ABI_VERSION})")
    return cdll


def _build() -> ctypes.CDLL:
    so = library_path()
    if so.exists():
        try:
            return _load(so)
        except (OSError, RuntimeError):
            pass  # unreadable or stale: build it again (a compiler is needed from here on)
    _compile(so)
    return _load(so)


def _declare(c) -> None:
    P, I64, I, U32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32
    c.cp_abi_version.restype = I
    c.cp_qsgd_encode.argtypes = [P, I, I64, I64, I, U32, P, P, I]
    c.cp_qsgd_encode.restype = None
    c.cp_qsgd_decode.argtypes = [P, P, I64, I64, I, P, I, I]
    c.cp_qsgd_decode.restype = None
    c.cp_sign_encode.argtypes = [P, I, I64, I64, I, P, P, I]
    c.cp_sign_encode.restype = None
    c.cp_sign_decode.argtypes = [P, P, I64, I64, P, I, I]
    c.cp_sign_decode.restype = None
    c.cp_topk_exact.argtypes = [P, I, I64, I64, P, P, P, P, P, I64, I]
    c.cp_topk_exact.restype = I
    F = ctypes.c_float
    c.cp_ss_quantize.argtypes = [P, I64, I64, I64, P, P, F, U32, I, P, P, I]
    c.cp_ss_quantize.restype = None
    c.cp_ss_decode.argtypes = [P, I, I64, I64, I64, P, P, I]
    c.cp_ss_decode.restype = None
    c.cp_momentum.argtypes = [P, P, P, I64, F, F, P, I]
    c.cp_momentum.restype = None
    c.cp_ef_update.argtypes = [P, P, P, P, P, I64, I]
    c.cp_ef_update.restype = None
    c.cp_randomk_indices.argtypes = [I64, I64, I, ctypes.c_uint64, ctypes.c_uint64, P, I]
    c.cp_randomk_indices.restype = None
    c.cp_outer_residual.argtypes = [P, P, I64, I64, I, P, P, I]
    c.cp_outer_residual.restype = None
    c.cp_outer_residual_into.argtypes = [P, P, I64, I64, I, P, P, P, I]
    c.cp_outer_residual_into.restype = None
    c.cp_div_add.argtypes = [P, P, I64, F, P, I]
    c.cp_div_add.restype = None
    c.cp_cast_finish.argtypes = [P, P, P, I, I64, I]
    c.cp_cast_finish.restype = None
    c.cp_outer_sync_send.argtypes = [P, P, P, P, I64, F, P, I]
    c.cp_outer_sync_send.restype = None
    c.cp_outer_sync_land.argtypes = [P, P, P, P, I64, I]
    c.cp_outer_sync_land.restype = None


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def lib(*tensors: torch.Tensor):
    """The loaded library, or None: switched off, not buildable, or a tensor not on the CPU
    (CUDA tensors keep their own dispatch)."""
    if not enabled() or any(t.device.type != "cpu" for t in tensors):
        return None
    c = _state.get("lib", False)
    if c is False:
        with _lock:
            c = _state.get("lib", False)
            if c is False:
                try:
                    c = _build()
                except Exception as e:  # no compiler, failed build, odd platform: torch path
                    _warn_fallback(e)
                    _state["error"] = repr(e)
                    c = None
                _state["lib"] = c
    return c


def _warn_fallback(exc: BaseException) -> None:
    # once per process (the outcome is cached in _state): the user should know why it is slow
    warnings.warn(f"commpress: compiled CPU codecs unavailable ({exc}); using the torch path, which "
                  "gives the same bits but is slower (exact top-k encode about 30x, 31 against "
                  "1.0 ns per element). Install g++ or share a cached build "
                  f"(${{COMMPRESS_CACHE_DIR}}); set {ENV_SWITCH}=0 to choose the torch path "
                  "silently.", CodecFallbackWarning, stacklevel=3)


def build_error() -> str | None:
    """Why :func:`lib` returned None after a build attempt (None when it loaded)."""
    return _state.get("error")


def threads() -> int:
    return max(1, torch.get_num_threads())


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def dtype_code(dtype: torch.dtype) -> int | None:
    return _DT.get(dtype)
