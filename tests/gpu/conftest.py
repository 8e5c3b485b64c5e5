"""GPU test helpers: every test here is marked ``gpu`` and skips cleanly without CUDA/CuPy."""

import os

import pytest
import torch


def kernels_available() -> bool:
    if not torch.cuda.is_available():
        return False
    from compressors.cuda import loader

    return loader.available(torch.device("cuda", 0))


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    skip = None
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        item.add_marker(pytest.mark.gpu)
        if skip is None:
            ok = kernels_available()
            skip = False if ok else pytest.mark.skip(
                reason="needs a CUDA device with CuPy and NVRTC (compressors.cuda.available)")
        if skip:
            item.add_marker(skip)


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
