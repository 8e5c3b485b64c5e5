"""The wheel ships every csrc/*.cu (as compressors/_csrc/) and the loader finds them there.

Builds the wheel from a copy of the project files (the working tree is left untouched) with
``python -m build --wheel --no-isolation`` (hatchling from the environment), unzips it, and
imports ``compressors.cuda.loader`` from the unzipped tree in a fresh interpreter.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CU_FILES = sorted(p.name for p in (ROOT / "csrc").glob("*.cu"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

_PROBE = r"""
import json, sys
from compressors.cuda import loader
import compressors
root = loader.source_root()
src = loader.load_source()
print(json.dumps({"pkg": compressors.__file__, "root": str(root), "files": loader.kernel_files(),
                  "src_len": len(src), "available_cpu": loader.available("cpu"),
                  "has": {n: ('#line 1 "%s"' % n) in src for n in loader.kernel_files() + [loader.HEADER]}}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("hatchling")
    pytest.importorskip("build")
    work = tmp_path_factory.mktemp("wheel")
    proj = work / "proj"
    proj.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, proj / name)
    for name in ("comms", "compressors", "csrc"):
        shutil.copytree(ROOT / name, proj / name, ignore=ignore)
    dist = work / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist),
                        str(proj)], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_every_cu_file_is_in_the_wheel(wheel):
    assert CU_FILES, "no csrc/*.cu in the checkout"
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in CU_FILES + ["common.cuh"]:
        assert f"compressors/_csrc/{f}" in names, f"{f} missing from {wheel.name}"
    assert "compressors/cuda/loader.py" in names


def test_loader_finds_the_sources_in_the_installed_layout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = dict(os.environ, PYTHONPATH=str(site), COMMPRESS_CUDA_KERNELS="1")
    r = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(info["pkg"]).resolve().is_relative_to(site.resolve()), info["pkg"]  # not the checkout
    assert Path(info["root"]).resolve() == (site / "compressors" / "_csrc").resolve()
    assert info["files"] == CU_FILES
    assert all(info["has"].values()), info["has"]
    expected = sum(len((ROOT / "csrc" / f).read_text()) for f in CU_FILES + ["common.cuh"])
    assert info["src_len"] > expected  # every file's text plus the #line marks
    assert info["available_cpu"] is False


def test_source_checkout_falls_back_to_repo_csrc():
    from compressors.cuda import loader

    assert loader.kernel_files() == CU_FILES
    assert Path(str(loader.source_root())).resolve() == (ROOT / "csrc").resolve()
    src = loader.load_source()
    for f in CU_FILES:
        assert f'#line 1 "{f}"' in src
