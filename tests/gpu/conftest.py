"""GPU test helpers: every test here is marked ``gpu`` and skips cleanly without CUDA/CuPy --
except where ``COMMPRESS_REQUIRE_CUPY`` is set (``make test`` on a CUDA machine): then a CUDA
device without CuPy fails every test instead of skipping it."""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Mark every test here ``gpu``; skip them without CUDA or CuPy. Where both exist and the
    kernels do not compile, every test FAILS with the compiler's message (the fixture below)."""
    here = os.path.dirname(os.path.abspath(__file__))
    status = None
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        item.add_marker(pytest.mark.gpu)
        if status is None:
            from gpu_helpers import kernel_status

            status = kernel_status()
            if status[0] == "skip" and os.environ.get("COMMPRESS_REQUIRE_CUPY") and torch.cuda.is_available():
                # `make test` on a CUDA machine installs the CuPy extra: its absence is a failure
                status = ("fail", f"COMMPRESS_REQUIRE_CUPY is set and a CUDA device is present, but {status[1]}")
            config._commpress_kernel_status = status
        if status[0] == "skip":
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA device with CuPy and NVRTC: {status[1]}"))


@pytest.fixture(autouse=True)
def _kernels_compiled(request):
    status = getattr(request.config, "_commpress_kernel_status", ("ok", ""))
    if status[0] == "fail":
        pytest.fail(status[1], pytrace=False)


@pytest.fixture
def torch_path(monkeypatch):
    """Context switch: inside ``with torch_path():`` the dispatch returns None (torch ops)."""
    import contextlib

    @contextlib.contextmanager
    def _off():
        monkeypatch.setenv("COMMPRESS_CUDA_KERNELS", "0")
        try:
            yield
        finally:
            monkeypatch.delenv("COMMPRESS_CUDA_KERNELS", raising=False)

    return _off
