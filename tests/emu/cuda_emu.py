"""Build and launch the ``csrc/`` kernels on the CPU through the CUDA emulator (cuda_emu.h).

:func:`build` compiles ``common.cuh`` and every ``csrc/*.cu`` file -- as ONE translation unit in
the loader's order (``compressors.cuda.loader.load_source``) -- with g++ as host C++20
(``-x c++ -std=c++20 -ffp-contract=off -D__CUDA_ARCH__=900 -include cuda_emu.h``, the kernel
code instrumented with ``-fsanitize=thread`` whose callbacks the emulator's runtime implements)
into a shared library, cached by a hash of every input (sources, header, runtime, flags,
compiler). :func:`translate` rewrites only what host C++ cannot express: ``__shared__``
declarations (per-block arena slots) and the inline PTX of the fp16 conversions (emulated). Each
kernel ``k`` gets an ``extern "C"`` entry ``emu_launch_k(cfg, argv, err, errlen)`` (grid, block,
dynamic shared bytes, schedule seed, workers, resident blocks, interleave probability; ``argv[i]`` points at parameter ``i``'s value, as
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
    "HERE", "HEADER", "RUNTIME", "CXXFLAGS", "KERNEL_FLAGS", "INSTRUMENT_FLAGS", "ASAN_FLAGS", "EmuError",
    "compiler", "kernel_names", "csrc_sources", "translate", "build", "asan_env", "EmuLibrary", "EmuBackend",
    "STATIC_SHARED", "GUARD_BYTES",
]

HERE = Path(__file__).resolve().parent
HEADER = HERE / "cuda_emu.h"
RUNTIME = HERE / "cuda_emu_runtime.cpp"
# -ffp-contract=off: no a*b+c fused into an FMA (the NVRTC build uses --fmad=false);
# no -ffast-math: IEEE semantics, NaN comparisons as written
CXXFLAGS = ("-std=c++20", "-O2", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-pthread",
            "-Wall", "-Wno-unused-variable", "-Wno-unused-function")
# the kernel translation unit only: the device branches (`#ifdef __CUDA_ARCH__`) are the ones
# compiled; no auto-vectorisation or loop-to-memcpy rewriting (an access would be merged or
# leave the instrumented code); no scalar replacement of aggregates, so a 16-byte vector load
# stays one 16-byte access whose alignment the runtime checks (SRA splits it into 4-byte ones)
KERNEL_FLAGS = ("-D__CUDA_ARCH__=900", "-fno-tree-vectorize", "-fno-tree-loop-distribute-patterns", "-fno-tree-sra")
# every load and store calls the runtime (alignment check, interleaving point); not with ASan,
# which GCC does not combine with it
INSTRUMENT_FLAGS = ("-fsanitize=thread",)
ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-O1")
KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')
_ALIGN = r"(?:__align__\(\s*\d+\s*\)\s+)?"
DYN_SHARED_RE = re.compile(r"extern\s+__shared__\s+" + _ALIGN + r"([A-Za-z_][\w\s]*?)\s+" + _ALIGN
                           + r"(\w+)\s*\[\s*\]\s*;")
STATIC_SHARED_RE = re.compile(r"(?:\bstatic\s+)?__shared__\s+" + _ALIGN + r"([A-Za-z_][\w\s:]*?)\s+" + _ALIGN
                              + r"(\w+)\s*((?:\[[^\]\[;]*\]\s*)*);")
# asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(in)) -- one output, one input
ASM_RE = re.compile(r'\basm\s*(?:volatile\s*)?\(\s*"((?:[^"\\]|\\.)*)"\s*:\s*"=\w+"\s*\(\s*(\w+)\s*\)\s*:'
                    r'\s*"\w+"\s*\(\s*([^()]+?)\s*\)\s*\)')
GUARD_BYTES = 4096  # canary bytes on each side of every tensor argument (EmuLibrary.launch)
# static shared memory per kernel as ptxas reports it (block_reduce_max_nan: 32 + 1 floats,
# padded); the emulator knows each declaration's size but not which kernel uses it: used by
# two_phase_fits
STATIC_SHARED = {"chunk_absmax": 144, "qsgd_quantize_fused": 144, "qsgd_encode_chunks": 144, "topk_compact": 144,
                 "two_phase_qsgd_owner": 144}


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


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def translate(sources) -> tuple[list[tuple[str, str]], list[tuple[int, str, str]]]:
    """``(sources, static_shared)``: every ``__shared__`` declaration rewritten to the
    emulator's per-block arena (``EMU_STATIC_SHARED`` / ``EMU_DYNAMIC_SHARED``), every
    ``asm("..." : "=c"(out) : "c"(in))`` to ``::emu::ptx_asm``; ``static_shared`` lists
    ``(id, type, dims)`` of the static declarations. Raises :class:`EmuError` on a
    declaration or an ``asm`` form it cannot rewrite."""
    out, static = [], []

    def static_decl(m):
        sid = len(static)
        static.append((sid, " ".join(m.group(1).split()), "".join(m.group(3).split())))
        return f"EMU_STATIC_SHARED({static[-1][1]}, {m.group(2)}, {static[-1][2]}, {sid});"

    for name, text in sources:
        text = DYN_SHARED_RE.sub(lambda m: f"EMU_DYNAMIC_SHARED({' '.join(m.group(1).split())}, {m.group(2)});", text)
        text = STATIC_SHARED_RE.sub(static_decl, text)
        text = ASM_RE.sub(lambda m: f'({m.group(2)} = ::emu::ptx_asm<decltype({m.group(2)})>("{m.group(1)}", {m.group(3)}))',
                          text)
        code = _strip_comments(text)
        for word in ("__shared__", "asm"):
            hit = re.search(r"\b" + word + r"\b", code)
            if hit:
                line = code[:hit.start()].count("\n") + 1
                raise EmuError(f"{name}: a {word} form the emulator cannot rewrite, near line {line}: "
                               f"{code[hit.start():hit.start() + 80]!r}")
        out.append((name, text))
    return out, static


def build(cache_dir, sources=None, asan: bool = False) -> Path:
    """The emulator library of ``sources`` (default :func:`csrc_sources`), built into
    ``cache_dir`` unless a build of the same inputs is there. Returns its path. ``asan``: an
    AddressSanitizer build (no per-access instrumentation: no interleaving, no scalar
    alignment checks in it)."""
    cxx = compiler()
    if cxx is None:
        raise EmuError("no C++ compiler (g++ / c++ / $CXX) found")
    sources, static = translate(list(csrc_sources() if sources is None else sources))
    flags = list(CXXFLAGS) + (list(ASAN_FLAGS) if asan else [])
    kflags = flags + list(KERNEL_FLAGS) + ([] if asan else list(INSTRUMENT_FLAGS))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for part in [version, " ".join(kflags), HEADER.read_text(), RUNTIME.read_text()] + [n + "\0" + t for n, t in sources]:
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
        tu = ["namespace emu {"] + [f"extern const unsigned long long emu_shared_off_{i};" for i, _, _ in static] + ["}"]
        exports = []
        for name, text in sources:
            (work / name).write_text(text, encoding="utf-8")
            tu.append(f'#include "{name}"')
            exports += kernel_names(text)
        tu += [f"EMU_EXPORT({k})" for k in exports]
        tu += ["namespace emu {"] + [
            f"const unsigned long long emu_shared_off_{i} = register_static_shared(sizeof({t}{d}), alignof({t}{d}));"
            for i, t, d in static] + ["}"]
        (work / "emu_kernels.cpp").write_text("\n".join(tu) + "\n")
        base = [cxx, "-x", "c++", *kflags, f"-I{HERE}", "-include", str(HEADER)]
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
                ("seed", ctypes.c_ulonglong), ("workers", ctypes.c_int), ("resident", ctypes.c_int),
                ("interleave", ctypes.c_double)]


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

    def launch(self, name, grid, block, shared_bytes, args, seed=0, workers=1, resident=1, interleave=0.0,
               guard=True) -> None:
        """Run kernel ``name``; ``args`` as ``loader.launch`` takes them (CPU tensors, None for a
        null pointer, numpy scalars of exactly the parameter's type). ``resident`` blocks run
        interleaved on each of ``workers`` OS threads; ``interleave`` is the probability of a
        scheduling point at each memory access. ``guard``: every tensor argument runs in a copy
        between :data:`GUARD_BYTES` canary bytes (same address modulo 256), so a write out of
        bounds is an :class:`EmuError`, not a corrupted heap. Raises :class:`EmuError`."""
        sig = self.signature(name)
        if len(args) != len(sig):
            raise EmuError(f"{name}: {len(args)} arguments for {len(sig)} parameters")
        guards = _Guards(args) if guard else None
        run_args = guards.args if guard else args
        keep, ptrs = [], (ctypes.c_void_p * max(1, len(args)))()
        for i, (a, (kind, size)) in enumerate(zip(run_args, sig)):
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
        cfg = _LaunchCfg((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), int(shared_bytes), int(seed), int(workers),
                         int(resident), float(interleave))
        err = ctypes.create_string_buffer(1024)
        f = getattr(self.lib, f"emu_launch_{name}")
        f.restype = ctypes.c_int
        rc = f(ctypes.byref(cfg), ptrs, err, ctypes.c_int(len(err)))
        if rc:
            raise EmuError(f"{name} grid={g} block={b} shared={shared_bytes}: {err.value.decode(errors='replace')}")
        if guard:
            guards.finish(name)


class _Guards:
    """Tensor arguments copied between canary bytes; :meth:`finish` checks the canaries and
    copies the results back. Arguments with the same address and size share one copy (a
    kernel may get one buffer twice: in-place residuals); ones that overlap otherwise run
    unguarded (their overlap is the kernel's contract, not something to break by copying)."""

    def __init__(self, args):
        spans = {}
        for a in args:
            if isinstance(a, torch.Tensor) and a.numel() and a.device.type == "cpu" and a.is_contiguous():
                spans[(a.data_ptr(), a.numel() * a.element_size())] = a
        keys = sorted(spans)
        clash = set()
        for k0, k1 in zip(keys, keys[1:]):
            if k1[0] < k0[0] + k0[1]:
                clash.update((k0, k1))
        self.copies = {}  # key -> (original, buffer, offset, guarded view)
        for key, a in spans.items():
            if key in clash:
                continue
            ptr, nbytes = key
            buf = torch.full((2 * GUARD_BYTES + nbytes + 256,), 0xA5, dtype=torch.uint8)
            off = GUARD_BYTES + (ptr - (buf.data_ptr() + GUARD_BYTES)) % 256
            buf[off:off + nbytes].copy_(a.reshape(-1).view(torch.uint8))
            self.copies[key] = (a, buf, off, buf[off:off + nbytes].view(a.dtype))
        self.args = [self._swap(a) for a in args]

    def _swap(self, a):
        if not isinstance(a, torch.Tensor) or not a.numel():
            return a
        c = self.copies.get((a.data_ptr(), a.numel() * a.element_size()))
        return a if c is None else c[3]

    def finish(self, name):
        for (ptr, nbytes), (a, buf, off, _) in self.copies.items():
            for lo, hi, where in ((0, off, "before"), (off + nbytes, buf.numel(), "past the end of")):
                bad = torch.nonzero(buf[lo:hi] != 0xA5).flatten()
                if bad.numel():
                    first = int(bad[0]) + lo - off
                    raise EmuError(f"{name}: a write {where} a {nbytes}-byte argument (byte offset {first}, "
                                   f"{bad.numel()} bytes changed): out of bounds")
            a.reshape(-1).view(torch.uint8).copy_(buf[off:off + nbytes])


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
        resident: blocks whose threads interleave on one worker (cross-block races show).
        interleave: probability of a scheduling point at each load / store of shared or global
            memory (0: only at synchronisation points).
        guard: run tensor arguments between canary bytes (out-of-bounds writes fail the launch).

    ``launches`` records ``(name, grid, block, shared_mem)`` of every launch.
    """

    def __init__(self, lib, block: int = 256, sms: int = 2, grid=None, seed: int = 0, workers: int = 1,
                 resident: int = 1, interleave: float = 0.0, guard: bool = True):
        self.lib = lib if isinstance(lib, EmuLibrary) else EmuLibrary(lib)
        self.BLOCK = block
        self.sms = sms
        self.grid = grid
        self.seed = seed
        self.workers = workers
        self.resident = resident
        self.interleave = interleave
        self.guard = guard
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

    def launch(self, name: str, index: int, grid: int, args, shared_mem: int = 0, block: int | None = None) -> None:
        g = self._grid(name, grid)
        b = min(block, self.BLOCK) if block else self.BLOCK  # the launcher's size, capped by the test's
        self.launches.append((name, g, b, shared_mem))
        self.lib.launch(name, g, b, shared_mem, args, seed=self.seed, workers=self.workers,
                        resident=self.resident, interleave=self.interleave, guard=self.guard)
