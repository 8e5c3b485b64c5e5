"""The compiled CPU codec loader: a cached build loads without a compiler; a fallback warns once.

Each case runs in a fresh interpreter (the loader caches its outcome per process), with
``COMMPRESS_CACHE_DIR`` pointing at a private folder and ``PATH`` / ``CXX`` set so that no
compiler can be found where the case says so.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = r"""
import warnings, torch
from compressors import cpu_kernels as ck
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    first = ck.lib(torch.zeros(1))
    second = ck.lib(torch.zeros(1))
print("LOADED", first is not None, second is not None)
print("WARNINGS", sum(issubclass(x.category, ck.CodecFallbackWarning) for x in w))
for x in w:
    print("MSG", x.message)
"""


def _run(env_extra: dict) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_extra)
    env.pop("COMMPRESS_CPU_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                       timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _no_compiler_env(tmp_path: Path) -> dict:
    # a PATH without g++/c++; CXX naming nothing makes the loader look on PATH
    bare = tmp_path / "bin"
    bare.mkdir(exist_ok=True)
    return {"PATH": str(bare), "CXX": ""}


def test_no_compiler_no_cache_warns_once_with_reason_and_cost(tmp_path):
    out = _run({"COMMPRESS_CACHE_DIR": str(tmp_path / "cache"), **_no_compiler_env(tmp_path)})
    assert "LOADED False False" in out, out
    assert "WARNINGS 1" in out, out
    assert "no C++ compiler" in out and "30x" in out, out


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="needs a C++ compiler")
def test_cached_build_loads_without_a_compiler(tmp_path):
    cache = tmp_path / "cache"
    built = _run({"COMMPRESS_CACHE_DIR": str(cache)})  # builds with the compiler on PATH
    assert "LOADED True True" in built and "WARNINGS 0" in built, built
    assert len(list(cache.glob("codec-*.so"))) == 1
    out = _run({"COMMPRESS_CACHE_DIR": str(cache), **_no_compiler_env(tmp_path)})
    assert "LOADED True True" in out and "WARNINGS 0" in out, out


def test_switched_off_is_silent(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), COMMPRESS_CPU_KERNELS="0",
               COMMPRESS_CACHE_DIR=str(tmp_path / "cache"), **_no_compiler_env(tmp_path))
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                       timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LOADED False False" in r.stdout and "WARNINGS 0" in r.stdout, r.stdout
