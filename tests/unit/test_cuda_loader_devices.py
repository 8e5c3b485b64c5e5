"""CPU checks (a fake CuPy) of the loader's per-device bookkeeping and of how the GPU suite
reacts to a compile failure: behaviour that otherwise only a multi-GPU machine would show."""

import types

import pytest
import torch

from compressors.cuda import dispatch, kernels, loader

from comms.algorithms import cuda_kernels as alg_cuda


class FakeCupy:
    """Enough of CuPy for the loader: a current device, modules and streams that remember the
    device they were created on."""

    def __init__(self, fail_compile=False):
        self.current = 0
        self.fail_compile = fail_compile
        cp = self

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                self.prev, cp.current = cp.current, self.index

            def __exit__(self, *exc):
                cp.current = self.prev

        class RawModule:
            def __init__(self, path):
                self.path = path
                self.loaded_on = []

            def get_function(self, name):
                if cp.fail_compile:
                    raise RuntimeError("nvrtc: error: identifier 'oops' is undefined")
                self.loaded_on.append(cp.current)
                return types.SimpleNamespace(name=name, device=cp.current, shared_size_bytes=144)

        class Stream:
            @staticmethod
            def from_external(ts):
                return types.SimpleNamespace(handle=ts.cuda_stream, device=cp.current)

        self.cuda = types.SimpleNamespace(Device=Device, Stream=Stream, ExternalStream=None)
        self.RawModule = RawModule


@pytest.fixture
def fake(monkeypatch):
    cp = FakeCupy()
    loader.reset()
    monkeypatch.setattr(loader, "_cupy", lambda: cp)
    monkeypatch.setattr(loader, "compile_module", lambda index: f"/cache/commpress-{index}.cubin")
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda index=None: types.SimpleNamespace(cuda_stream=0, device_index=index))
    yield cp
    loader.reset()


def test_default_streams_of_two_devices_get_their_own_wrappers(fake):
    # the default stream's handle is 0 on every device: keyed by handle alone, GPU 1 got GPU 0's
    s0 = loader.current_stream(0)
    s1 = loader.current_stream(1)
    assert s0 is not s1
    assert (s0.device, s1.device) == (0, 1)
    assert loader.current_stream(1) is s1  # still memoised


def test_kernels_load_on_their_device_from_a_thread_on_device_0(fake):
    fake.current = 0  # a DDP callback thread whose current device was never set
    k = loader.get_kernel("sign_pack", 1)
    assert k.device == 1
    assert loader._modules[1].loaded_on == [1, 1]  # the compile check and the function
    assert fake.current == 0


def test_static_shared_bytes_reads_the_compiled_kernel(fake):
    assert loader.static_shared_bytes("two_phase_qsgd_owner", 0) == 144


class FakeBackend:
    BLOCK = 256

    def __init__(self, static):
        self.static = static
        self.launches = []

    def static_shared_bytes(self, name, index):
        return self.static

    def grid_for(self, work_items, index, per_block=None, blocks_per_sm=16):
        return 1

    def launch(self, name, index, grid, args, shared_mem=0, block=None):
        self.launches.append((name, shared_mem))


@pytest.mark.parametrize("static,world,chunk,fits", [(144, 6127, 64, False), (0, 6127, 64, True),
                                                     (144, 6126, 64, True), (144, 4, 60, False)])
def test_two_phase_shared_memory_counts_static(monkeypatch, static, world, chunk, fits):
    """The owner kernel keeps 8 B of dynamic shared memory per rank: 6127 ranks are 49016 B,
    which with the 144 B of static shared memory no longer fit 48 KiB, so dispatch declines
    (the torch path runs) instead of launching a kernel that fails with no fallback; a chunk
    that is not a multiple of 8 declines too."""
    import compressors

    be = FakeBackend(static)
    prev = kernels.set_backend(be)
    try:
        monkeypatch.setattr(dispatch, "enabled_for", lambda *ts: True)
        q = compressors.QSGD(bits=8, chunk=chunk)
        m = chunk
        recv = torch.zeros(world * (4 + m), dtype=torch.uint8)
        out = alg_cuda.two_phase_qsgd_owner(q, recv, world, m, compressors.Context(numel=m))
        assert (out is not None) == fits
        assert be.launches == ([("two_phase_qsgd_owner", 8 * world)] if fits else [])
    finally:
        kernels.set_backend(prev)


def test_gpu_suite_fails_instead_of_skipping_on_a_compile_error(monkeypatch):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "gpu_helpers_under_test", Path(__file__).resolve().parents[1] / "gpu" / "gpu_helpers.py")
    gh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gh)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gh.kernel_status()[0] == "skip"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cp = FakeCupy(fail_compile=True)
    loader.reset()
    monkeypatch.setattr(loader, "_cupy", lambda: cp)
    monkeypatch.setattr(loader, "compile_module", lambda index: f"/cache/commpress-{index}.cubin")
    try:
        status, why = gh.kernel_status()
        assert status == "fail" and "identifier 'oops' is undefined" in why
        loader.reset()
        cp.fail_compile = False
        assert gh.kernel_status() == ("ok", "")

        def no_cupy():
            raise ImportError("No module named 'cupy'")

        monkeypatch.setattr(loader, "_cupy", no_cupy)
        assert gh.kernel_status()[0] == "skip"
    finally:
        loader.reset()


class FakeNvrtc:
    """Records each compile's options; ``sm_`` targets fail when ``knows_sm`` is False."""

    def __init__(self, knows_sm=True):
        self.knows_sm, self.compiles = knows_sm, []

    def getVersion(self):
        return (13, 0)

    def createProgram(self, src, name, headers, include_names):
        return object()

    def compileProgram(self, prog, options):
        self.compiles.append(list(options))
        if not self.knows_sm and any(o.startswith("-arch=sm_") for o in options):
            raise RuntimeError("nvrtc: error: invalid value for --gpu-architecture")

    def getCUBIN(self, prog):
        return b"cubin"

    def getPTX(self, prog):
        return b"ptx"

    def getProgramLog(self, prog):
        return ""

    def destroyProgram(self, prog):
        pass


@pytest.mark.parametrize("knows_sm", [True, False])
def test_compile_module_calls_nvrtc_itself_without_flush_to_zero(monkeypatch, tmp_path, knows_sm):
    # CuPy's RawModule(code=...) appends -ftz=true after the caller's options (NVRTC takes the
    # last): subnormal scales flushed to 0 on an H200. The loader compiles with NVRTC itself.
    nv = FakeNvrtc(knows_sm)
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda index: types.SimpleNamespace(compute_capability="90")))
    monkeypatch.setattr(loader, "_cupy", lambda: cp)
    monkeypatch.setattr(loader, "_nvrtc", lambda: nv)
    monkeypatch.setenv("COMMPRESS_KERNEL_CACHE", str(tmp_path))
    path = loader.compile_module(0)
    opts = nv.compiles[-1]
    assert opts[:len(loader.NVRTC_OPTIONS)] == list(loader.NVRTC_OPTIONS)
    assert "--ftz=false" in opts and not any(o in ("-ftz=true", "--ftz=true") for o in opts)
    assert "--fmad=false" in opts
    want = ("cubin", b"cubin", "-arch=sm_90") if knows_sm else ("ptx", b"ptx", "-arch=compute_90")
    assert path.suffix == "." + want[0] and path.read_bytes() == want[1] and opts[-1] == want[2]
    n = len(nv.compiles)
    assert loader.compile_module(0) == path and len(nv.compiles) == n  # cached: no second compile
