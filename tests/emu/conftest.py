"""Fixtures of the CPU emulator suite: the emulator build (cached under pytest's cache), a
backend switch that routes compressors.cuda.kernels to it, and the count of launches per
entry point (printed at the end of the run). Every test here skips, saying why, where no C++
compiler exists -- unless ``COMMPRESS_REQUIRE_EMU`` is set (CI), which makes that an error;
nothing else skips."""

import collections
import os
import tempfile

import pytest

import cuda_emu

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHES = collections.Counter()  # kernel name -> launches over the session
CASES = collections.Counter()     # kernel name -> distinct (test case, launch shape) pairs


def pytest_collection_modifyitems(config, items):
    if cuda_emu.compiler() is not None:
        return
    mine = [item for item in items if str(item.fspath).startswith(HERE)]
    if mine and os.environ.get("COMMPRESS_REQUIRE_EMU"):
        # CI sets it: a green run must not hide a suite that never ran
        raise pytest.UsageError("COMMPRESS_REQUIRE_EMU is set but there is no C++ compiler (g++, c++ or $CXX): "
                                "the CUDA emulator suite (tests/emu) cannot run")
    skip = pytest.mark.skip(reason="no C++ compiler (g++, c++ or $CXX): the CUDA emulator suite needs one")
    for item in mine:
        item.add_marker(skip)


def emu_cache_dir(config) -> str:
    d = os.environ.get("COMMPRESS_EMU_CACHE")
    if d:
        return d
    cache = getattr(config, "cache", None)
    if cache is None:  # -p no:cacheprovider: a per-user temp folder, still keyed by source hash
        d = os.path.join(tempfile.gettempdir(), f"commpress-emu-{os.getuid()}")
        os.makedirs(d, exist_ok=True)
        return d
    return str(cache.mkdir("cuda_emu"))


@pytest.fixture(scope="session")
def emu_lib(request):
    """The emulator library of the csrc/ sources (built once per source hash)."""
    return cuda_emu.EmuLibrary(cuda_emu.build(emu_cache_dir(request.config)))


@pytest.fixture(scope="session")
def emu_cache(request):
    """The folder the suite's builds are cached in."""
    return emu_cache_dir(request.config)


@pytest.fixture(scope="session")
def emu_build(request):
    """``build(sources, asan=False) -> path`` into the suite's cache (for altered copies)."""
    def _build(sources=None, asan=False):
        return cuda_emu.build(emu_cache_dir(request.config), sources, asan=asan)
    return _build


@pytest.fixture
def emu(emu_lib, monkeypatch, request):
    """``emu(**EmuBackend options)``: route compressors.cuda.kernels to the emulator, and let
    compressors.cuda.dispatch accept CPU tensors (its own checks, contiguity and one device,
    still apply). Returns the backend; restored at the end of the test."""
    from compressors.cuda import dispatch, kernels

    def cpu_enabled_for(*tensors):
        import torch
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            return False
        return all(t.device == tensors[0].device and t.is_contiguous() for t in tensors)

    monkeypatch.setattr(dispatch, "enabled_for", cpu_enabled_for)
    backends = []

    def use(lib=None, **kw):
        be = cuda_emu.EmuBackend(lib or emu_lib, **kw)
        backends.append(be)
        kernels.set_backend(be)
        return be

    yield use
    kernels.set_backend(None)
    for be in backends:
        seen = set()
        for name, grid, block, shared in be.launches:
            LAUNCHES[name] += 1
            seen.add(name)
        for name in seen:
            CASES[name] += 1


def pytest_terminal_summary(terminalreporter):
    if not LAUNCHES:
        return
    tr = terminalreporter
    tr.section("CUDA emulator: launches per csrc entry point")
    for name in sorted(LAUNCHES):
        tr.write_line(f"{name:24s} {LAUNCHES[name]:6d} launches in {CASES[name]:4d} backend configurations")
