"""Find, compile and launch the CUDA kernels of ``csrc/`` with CuPy (imported lazily).

Sources are found through :mod:`importlib.resources`: an installed wheel carries them as
``compressors/_csrc/`` (pyproject force-include ``"csrc" = "compressors/_csrc"``); a source
checkout falls back to ``<repo>/csrc``. ``common.cuh`` and every ``*.cu`` file are compiled as
ONE NVRTC translation unit per device, by NVRTC itself (:func:`compile_module`), with
:data:`NVRTC_OPTIONS`: ``--fmad=false`` so no multiply-add is contracted into an FMA, which would
change the bits against the torch reference; ``--ftz=false`` and IEEE division and square root
stated, because a subnormal scale must survive as it does on the CPU. Memoised per device.

Tensors cross with ``cupy.from_dlpack`` (no copy; fp16/bf16 are viewed as int16 because CuPy
has no bfloat16) and kernels are launched on ``cupy.cuda.Stream.from_external`` of torch's
current stream, so they are ordered with torch's own kernels and nothing waits on the host.

Example::

    >>> from compressors.cuda import loader
    >>> loader.kernel_files()           # works without CuPy or a GPU
    ['pack.cu', 'quantize.cu', 'shared_scale.cu', 'sign.cu', 'topk.cu', 'two_phase.cu']
    >>> loader.available(torch.device("cpu"))
    False

.. warning::
    Set ``COMMPRESS_CUDA_KERNELS=0`` to force the torch path (e.g. to compare). Every rank of a
    job must take the same path: see the division note in ``compressors/cuda/dispatch.py``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import logging
import os
import tempfile
import threading
from pathlib import Path

import torch

__all__ = [
    "NVRTC_OPTIONS", "HEADER", "compile_module", "BLOCK", "source_root", "kernel_files", "load_source", "available",
    "get_kernel", "current_stream", "as_cupy", "launch", "grid_for", "static_shared_bytes", "reset",
]

logger = logging.getLogger(__name__)

NVRTC_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "-std=c++17")
HEADER = "common.cuh"
BLOCK = 256  # threads per block for every kernel (a multiple of 32, as the kernels require)
_ENV_SWITCH = "COMMPRESS_CUDA_KERNELS"

_lock = threading.Lock()
_modules: dict = {}      # device index -> cupy.RawModule (or the exception that stopped it)
_kernels: dict = {}      # (device index, name) -> cupy.RawKernel
_streams: dict = {}      # (device index, torch stream handle) -> cupy Stream wrapping it
_sm_count: dict = {}     # device index -> multiprocessors


def source_root():
    """The folder of the ``.cu`` files: the installed package's ``_csrc``, else ``<repo>/csrc``."""
    try:
        root = importlib.resources.files("compressors").joinpath("_csrc")
        if root.is_dir():
            return root
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - odd import setups
        pass
    return Path(__file__).resolve().parents[2] / "csrc"


def kernel_files() -> list[str]:
    """Sorted names of the ``*.cu`` sources the loader compiles."""
    root = source_root()
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".cu"))


def load_source() -> str:
    """``common.cuh`` then every ``.cu`` file, with ``#line`` marks for readable NVRTC errors."""
    root = source_root()
    parts = []
    for name in [HEADER] + kernel_files():
        text = root.joinpath(name).read_text(encoding="utf-8")
        parts.append(f'#line 1 "{name}"\n{text}\n')
    return "".join(parts)


def _cupy():
    return importlib.import_module("cupy")


def _enabled() -> bool:
    return os.environ.get(_ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc  # CuPy's own NVRTC bindings

    return nvrtc


def compile_module(index: int) -> Path:
    """Compile :func:`load_source` with :data:`NVRTC_OPTIONS` for device ``index`` and return
    the path of the binary (a cubin for ``sm_XY``; PTX for ``compute_XY`` where this NVRTC does
    not know the chip), cached by a hash of source, options and target.

    NVRTC is called directly, not through ``cupy.RawModule(code=...)``: CuPy appends
    ``-ftz=true`` to every option list it compiles and NVRTC honours the last occurrence, so
    subnormal inputs and scales would flush to zero on the GPU (a scale of 2.5e-44 came back 0
    on an H200) while the torch reference keeps them: the bits would differ.
    """
    cp = _cupy()
    nvrtc = _nvrtc()
    cc = cp.cuda.Device(index).compute_capability  # e.g. "90"
    src = load_source()
    cache = Path(os.environ.get("COMMPRESS_KERNEL_CACHE")
                 or Path(tempfile.gettempdir()) / f"commpress-kernels-{os.getuid()}")
    cache.mkdir(parents=True, exist_ok=True)
    targets = []
    for target, ext in ((f"-arch=sm_{cc}", "cubin"), (f"-arch=compute_{cc}", "ptx")):
        options = list(NVRTC_OPTIONS) + [target]
        key = hashlib.sha256("\0".join([src, *options, str(nvrtc.getVersion())]).encode()).hexdigest()[:24]
        targets.append((target, ext, options, cache / f"commpress-{key}.{ext}"))
    for *_, path in targets:
        if path.exists():
            return path
    errors = []
    for target, ext, options, path in targets:
        prog = nvrtc.createProgram(src, "commpress.cu", (), ())
        try:
            nvrtc.compileProgram(prog, options)
            binary = nvrtc.getCUBIN(prog) if ext == "cubin" else nvrtc.getPTX(prog)
        except Exception as e:  # an unknown sm_ target, or a compile error (then both fail)
            try:
                log = nvrtc.getProgramLog(prog)
            except Exception:
                log = ""
            errors.append(f"{target}: {type(e).__name__}: {e}\n{log}")
            continue
        finally:
            nvrtc.destroyProgram(prog)
        if isinstance(binary, str):
            binary = binary.encode()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(binary)
        os.replace(tmp, path)  # atomic: a concurrent rank reads a whole file or none
        return path
    raise RuntimeError("NVRTC could not compile the csrc kernels:\n" + "\n".join(errors))


def _module(index: int):
    mod = _modules.get(index)
    if mod is None:
        with _lock:
            mod = _modules.get(index)
            if mod is None:
                try:
                    cp = _cupy()
                    # CuPy loads a RawModule into the context current when it first compiles
                    # (get_function), so compile inside the device scope: a DDP callback thread
                    # whose current device is still 0 would otherwise load it (and create a
                    # context) on GPU 0 for a tensor on GPU `index`
                    with cp.cuda.Device(index):
                        mod = cp.RawModule(path=str(compile_module(index)))
                        mod.get_function("pack_bits")  # load now, so failures surface here
                except Exception as e:  # no NVRTC, no driver, compile error: the torch path runs
                    logger.warning("CUDA kernels unavailable on device %d (%s: %s); using torch ops",
                                   index, type(e).__name__, e)
                    mod = e
                _modules[index] = mod
    if isinstance(mod, Exception):
        raise RuntimeError(f"CUDA kernels unavailable on device {index}") from mod
    return mod


def available(device) -> bool:
    """True when ``device`` is a CUDA device, CuPy imports and the kernels compile there.

    Never raises; False without CuPy, without CUDA, for CPU devices, or with
    ``COMMPRESS_CUDA_KERNELS=0``. The first call per device compiles (memoised).
    """
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError):
        return False
    if device.type != "cuda" or not _enabled() or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if index in _modules:
        return not isinstance(_modules[index], Exception)
    try:
        _cupy()
    except Exception:  # ImportError, or a CuPy built for another CUDA
        return False
    try:
        _module(index)
        return True
    except RuntimeError:
        return False


def get_kernel(name: str, index: int):
    """The memoised ``cupy.RawKernel`` ``name`` compiled for device ``index``."""
    key = (index, name)
    k = _kernels.get(key)
    if k is None:
        mod = _module(index)
        with _cupy().cuda.Device(index):  # the function handle belongs to that device's context
            k = _kernels[key] = mod.get_function(name)
    return k


def current_stream(index: int):
    """CuPy's view of torch's current stream on device ``index`` (memoised per stream).

    Keyed by ``(index, handle)``: the raw handle alone is not unique across devices (the
    default stream is 0 on every GPU), and a wrapper made for GPU 0's stream would run GPU 1's
    kernels on GPU 0's stream."""
    ts = torch.cuda.current_stream(index)
    handle = ts.cuda_stream
    key = (index, handle)
    s = _streams.get(key)
    if s is None:
        cp = _cupy()
        with cp.cuda.Device(index):
            try:
                s = cp.cuda.Stream.from_external(ts)
            except (AttributeError, TypeError):  # CuPy < 14 or torch without __cuda_stream__
                s = cp.cuda.ExternalStream(handle, index)
        _streams[key] = s
    return s


_VIEW_AS = {torch.float16: torch.int16, torch.bfloat16: torch.int16}


def as_cupy(t: torch.Tensor):
    """A zero-copy CuPy view of a contiguous CUDA tensor (fp16/bf16 viewed as int16)."""
    t = t.detach()
    if t.dtype in _VIEW_AS:
        t = t.view(_VIEW_AS[t.dtype])
    return _cupy().from_dlpack(t)


def _sms(index: int) -> int:
    n = _sm_count.get(index)
    if n is None:
        n = _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def grid_for(work_items: int, index: int, per_block: int = BLOCK, blocks_per_sm: int = 16) -> int:
    """Blocks for a grid-stride kernel over ``work_items`` (at least 1)."""
    need = -(-max(work_items, 1) // per_block)
    return max(1, min(need, _sms(index) * blocks_per_sm))


STATIC_SHARED_FALLBACK = 1024  # assumed static shared memory when CuPy cannot report it


def static_shared_bytes(name: str, index: int) -> int:
    """Static shared memory of kernel ``name`` on device ``index`` as compiled (the
    ``shared_size_bytes`` attribute); :data:`STATIC_SHARED_FALLBACK` when it cannot be read."""
    kern = get_kernel(name, index)
    try:
        with _cupy().cuda.Device(index):
            return int(kern.shared_size_bytes)
    except Exception:  # an older CuPy without the attribute
        try:
            return int(kern.attributes["shared_size_bytes"])
        except Exception:
            return STATIC_SHARED_FALLBACK


def launch(name: str, index: int, grid: int, args, shared_mem: int = 0, block: int | None = None) -> None:
    """Launch kernel ``name`` on torch's current stream of device ``index`` with ``block``
    threads per block (default :data:`BLOCK`; a multiple of 32, at most 1024).

    ``args`` may hold torch CUDA tensors (crossed with DLPack), ``None`` (a null pointer) and
    numpy scalars; nothing synchronises with the host.
    """
    import numpy as np

    kern = get_kernel(name, index)
    with _cupy().cuda.Device(index), current_stream(index):
        conv = []
        for a in args:
            if isinstance(a, torch.Tensor):
                conv.append(as_cupy(a))
            elif a is None:
                conv.append(np.uint64(0))
            else:
                conv.append(a)
        kern((grid,), (block or BLOCK,), tuple(conv), shared_mem=shared_mem)


def reset() -> None:
    """Forget compiled modules and stream wrappers (tests; after a device reset)."""
    with _lock:
        _modules.clear()
        _kernels.clear()
        _streams.clear()
