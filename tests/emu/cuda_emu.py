"""Build and launch the ``csrc/`` kernels on the CPU through the CUDA emulator (cuda_emu.h).

:func:`build` compiles ``common.cuh`` and every ``csrc/*.cu`` file -- unmodified, as ONE
translation unit in the loader's order (``compressors.cuda.loader.load_source``) -- with g++
as host C++20 (``-x c++ -std=c++20 -ffp-contract=off -include cuda_emu.h``) into a shared
library, cached by a hash of every input (sources, header, runtime, flags, compiler). Each
kernel ``k`` gets an ``extern "C"`` entry ``emu_launch_k(cfg, argv, err, errlen)`` (grid, block,
dynamic shared bytes, schedule seed, workers; ``argv[i]`` points at parameter ``i``'s value, as
``cuLaunchKernel``'s ``kernelParams``) and ``emu_sig_k()`` (its parameter kinds and sizes, which
the launcher checks every argument against).

:class:`EmuBackend` has ``compressors.cuda.loader``'s launch interface (``BLOCK``,
``grid_for``, ``launch``, ``static_shared_bytes``) over CPU torch tensors, so
``compressors.cuda.kernels.set_backend(EmuBackend(...))`` runs the real launchers (argument
and launch-shape computation included) on the emulator. Launch shapes can be overridden
(one block; many more blocks than work; few, so the grid-stride loops run) and the schedule
shuffled by a seed.

Example::

    >>> lib = build(cache_dir)                      # ~10 s the first time, then cached
    >>> prev = kernels.set_backend(EmuBackend(lib, grid="one", seed=3))
    >>> scales, packed = kernels.qsgd_compress(torch.randn(1000), 4, 128, key=5)

AddressSanitizer: ``build(..., asan=True)`` adds ``-fsanitize=address``; loading that library
needs libasan first in the process (``LD_PRELOAD``, see :func:`asan_env`), so ASan runs in a
subprocess.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "HERE", "HEADER", "RUNTIME", "CXXFLAGS", "ASAN_FLAGS", "EmuError", "compiler", "kernel_names",
    "csrc_sources", "build", "asan_env", "EmuLibrary", "EmuBackend", "STATIC_SHARED",
]

HERE = Path(__file__).resolve().parent
HEADER = HERE / "cuda_emu.h"
RUNTIME = HERE / "cuda_emu_runtime.cpp"
# -ffp-contract=off: no a*b+c fused into an FMA (the NVRTC build uses --fmad=false);
# no -ffast-math: IEEE semantics, NaN comparisons as written
CXXFLAGS = ("-std=c++20", "-O2", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-pthread",
            "-Wall", "-Wno-unused-variable", "-Wno-unused-function")
ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-O1")
KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')
DYN_SHARED_RE = re.compile(r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([A-Za-z_][\w\s]*?)\s+(\w+)\s*\[\s*\]")
# static shared memory per kernel as ptxas reports it (block_reduce_max_nan: 32 + 1 floats,
# padded); the emulator cannot measure it (thread_local arrays): used by two_phase_fits
STATIC_SHARED = {"chunk_absmax": 144, "qsgd_quantize_fused": 144, "two_phase_qsgd_owner": 144}


class EmuError(RuntimeError):
    """A launch the emulator refused or a kernel failure it detected (deadlock, bad mask...)."""


def compiler() -> str | None:
    """The C++ compiler to use: ``$CXX``, else g++, else c++; None when there is none."""
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return shutil.which(cxx)
    return shutil.which("g++") or shutil.which("c++")


def kernel_names(text: str) -> list[str]:
    """The ``extern "C" __global__`` kernels defined in ``text``, in order."""
    return KERNEL_RE.findall(text)


def csrc_sources() -> list[tuple[str, str]]:
    """``[(file name, text)]``: ``common.cuh`` then every ``.cu`` in the loader's order."""
    from compressors.cuda import loader

    root = loader.source_root()
    return [(name, root.joinpath(name).read_text(encoding="utf-8"))
            for name in [loader.HEADER] + loader.kernel_files()]


def _run(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode:
        raise EmuError(f"compile failed: {' '.join(map(str, cmd))}\n{r.stdout}{r.stderr}")


def build(cache_dir, sources=None, asan: bool = False) -> Path:
    """The emulator library of ``sources`` (default :func:`csrc_sources`), built into
    ``cache_dir`` unless a build of the same inputs is there. Returns its path."""
    cxx = compiler()
    if cxx is None:
        raise EmuError("no C++ compiler (g++ / c++ / $CXX) found")
    sources = list(csrc_sources() if sources is None else sources)
    flags = list(CXXFLAGS) + (list(ASAN_FLAGS) if asan else [])
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for part in [version, " ".join(flags), HEADER.read_text(), RUNTIME.read_text()] + [n + "\0" + t for n, t in sources]:
        h.update(part.encode())
        h.update(b"\1")
    key = h.hexdigest()[:20]
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"cuda_emu-{key}{'-asan' if asan else ''}.so"
    if out.exists():
        return out
    work = Path(tempfile.mkdtemp(prefix="build-", dir=cache_dir))
    try:
        tu = []
        exports, dyn = [], {}
        for name, text in sources:
            (work / name).write_text(text, encoding="utf-8")
            tu.append(f'#include "{name}"')
            exports += kernel_names(text)
            for typ, var in DYN_SHARED_RE.findall(text):
                dyn[var] = " ".join(typ.split())
        tu += [f"EMU_EXPORT({k})" for k in exports]
        tu += [f"EMU_DYNAMIC_SHARED({typ}, {var})" for var, typ in dyn.items()]
        (work / "emu_kernels.cpp").write_text("\n".join(tu) + "\n")
        base = [cxx, "-x", "c++", *flags, f"-I{HERE}", "-include", str(HEADER)]
        procs = [subprocess.Popen(base + ["-c", "emu_kernels.cpp", "-o", "k.o"], cwd=work,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
                 subprocess.Popen([cxx, "-x", "c++", *flags, f"-I{HERE}", "-c", str(RUNTIME), "-o", "r.o"],
                                  cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
        for p in procs:
            log = p.communicate()[0]
            if p.returncode:
                raise EmuError(f"compile failed: {' '.join(map(str, p.args))}\n{log}")
        _run([cxx, *flags, "-shared", "k.o", "r.o", "-o", "lib.so"], work)
        os.replace(work / "lib.so", out)  # atomic: a concurrent build just wins or loses
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def asan_env(env=None) -> dict:
    """Environment for a subprocess that loads an ASan build: libasan preloaded (a Python
    interpreter is not linked with it), leak checks off (the interpreter's own allocations)."""
    env = dict(os.environ if env is None else env)
    cxx = compiler()
    lib = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    env["LD_PRELOAD"] = lib
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:halt_on_error=1:exitcode=66"
    return env


class _LaunchCfg(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_ulonglong),
                ("seed", ctypes.c_ulonglong), ("workers", ctypes.c_int)]


_CTYPE = {("i", 4): ctypes.c_int32, ("i", 8): ctypes.c_int64, ("u", 4): ctypes.c_uint32,
          ("u", 8): ctypes.c_uint64, ("f", 4): ctypes.c_float, ("f", 8): ctypes.c_double,
          ("i", 1): ctypes.c_int8, ("u", 1): ctypes.c_uint8, ("i", 2): ctypes.c_int16, ("u", 2): ctypes.c_uint16}
_NP_KIND = {"i": "i", "u": "u", "f": "f"}


class EmuLibrary:
    """A loaded emulator build: ``launch(name, grid, block, shared, args, seed, workers)``."""

    def __init__(self, path):
        self.path = Path(path)
        self.lib = ctypes.CDLL(str(self.path))
        self._sigs: dict = {}

    def signature(self, name: str) -> list[tuple[str, int]]:
        sig = self._sigs.get(name)
        if sig is None:
            try:
                f = getattr(self.lib, f"emu_sig_{name}")
            except AttributeError:
                raise EmuError(f"no kernel {name!r} in {self.path.name}") from None
            f.restype = ctypes.c_char_p
            text = f().decode()
            sig = self._sigs[name] = [(p[0], int(p[1:])) for p in text.split(",")] if text else []
        return sig

    def launch(self, name, grid, block, shared_bytes, args, seed=0, workers=1) -> None:
        """Run kernel ``name``; ``args`` as ``loader.launch`` takes them (CPU tensors, None for a
        null pointer, numpy scalars of exactly the parameter's type). Raises :class:`EmuError`."""
        sig = self.signature(name)
        if len(args) != len(sig):
            raise EmuError(f"{name}: {len(args)} arguments for {len(sig)} parameters")
        keep, ptrs = [], (ctypes.c_void_p * max(1, len(args)))()
        for i, (a, (kind, size)) in enumerate(zip(args, sig)):
            if kind == "p":
                if a is None:
                    v = ctypes.c_void_p(None)
                elif isinstance(a, torch.Tensor):
                    if a.device.type != "cpu" or not a.is_contiguous():
                        raise EmuError(f"{name}: argument {i} must be a contiguous CPU tensor")
                    v = ctypes.c_void_p(a.data_ptr() if a.numel() else None)
                else:
                    raise EmuError(f"{name}: argument {i} must be a tensor or None, got {type(a).__name__}")
            else:
                if not isinstance(a, np.generic) or a.dtype.kind != _NP_KIND[kind] or a.dtype.itemsize != size:
                    raise EmuError(f"{name}: argument {i} is {a!r} ({type(a).__name__}); the kernel takes "
                                   f"kind {kind!r} of {size} bytes (pass the numpy scalar type)")
                v = _CTYPE[(kind, size)](a.item())
            keep.append(v)
            ptrs[i] = ctypes.cast(ctypes.pointer(v), ctypes.c_void_p)
        g = tuple(grid) + (1,) * (3 - len(grid)) if isinstance(grid, tuple) else (int(grid), 1, 1)
        b = tuple(block) + (1,) * (3 - len(block)) if isinstance(block, tuple) else (int(block), 1, 1)
        cfg = _LaunchCfg((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), int(shared_bytes), int(seed), int(workers))
        err = ctypes.create_string_buffer(1024)
        f = getattr(self.lib, f"emu_launch_{name}")
        f.restype = ctypes.c_int
        rc = f(ctypes.byref(cfg), ptrs, err, ctypes.c_int(len(err)))
        if rc:
            raise EmuError(f"{name} grid={g} block={b} shared={shared_bytes}: {err.value.decode(errors='replace')}")


class EmuBackend:
    """``compressors.cuda.loader``'s launch interface over the emulator (CPU tensors).

    Args:
        lib: an :class:`EmuLibrary` (or a path to a build).
        block: threads per block (``BLOCK``; a multiple of 32, <= 1024, as the kernels need).
        sms: multiprocessors to pretend (``grid_for`` caps grid-stride grids at ``16 * sms``).
        grid: None (the launchers' own grid), an int (that many blocks), "one" (1 block),
            "many" (3x + 5 blocks: more than chunks/work) or "few" (grid // 8 + 1, so grid-stride
            loops iterate), or a callable ``(name, grid) -> grid``.
        seed: 0 runs blocks and threads in index order; else the schedule is shuffled.
        workers: OS threads running blocks concurrently.

    ``launches`` records ``(name, grid, block, shared_mem)`` of every launch.
    """

    def __init__(self, lib, block: int = 256, sms: int = 2, grid=None, seed: int = 0, workers: int = 1):
        self.lib = lib if isinstance(lib, EmuLibrary) else EmuLibrary(lib)
        self.BLOCK = block
        self.sms = sms
        self.grid = grid
        self.seed = seed
        self.workers = workers
        self.launches: list[tuple] = []

    def grid_for(self, work_items: int, index: int, per_block: int | None = None, blocks_per_sm: int = 16) -> int:
        per_block = per_block or self.BLOCK
        need = -(-max(work_items, 1) // per_block)
        return max(1, min(need, self.sms * blocks_per_sm))

    def static_shared_bytes(self, name: str, index: int) -> int:
        return STATIC_SHARED.get(name, 0)

    def _grid(self, name: str, grid: int) -> int:
        g = self.grid
        if g is None:
            return grid
        if callable(g):
            return int(g(name, grid))
        if g == "one":
            return 1
        if g == "many":
            return 3 * grid + 5
        if g == "few":
            return grid // 8 + 1
        return int(g)

    def launch(self, name: str, index: int, grid: int, args, shared_mem: int = 0) -> None:
        g = self._grid(name, grid)
        self.launches.append((name, g, self.BLOCK, shared_mem))
        self.lib.launch(name, g, self.BLOCK, shared_mem, args, seed=self.seed, workers=self.workers)
