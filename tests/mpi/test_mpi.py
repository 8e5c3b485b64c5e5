"""MPI backend: ``mpiexec -n 2`` and ``-n 3`` in a subprocess (PyPI mpich wheel works as root).

Skipped cleanly when mpi4py or mpiexec is missing.
"""

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
MPIEXEC = (shutil.which("mpiexec", path=os.path.dirname(sys.executable))
           or shutil.which("mpiexec") or shutil.which("mpirun"))

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")]


def _mpiexec(n, *args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [MPIEXEC, "-n", str(n), sys.executable, *args]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s:\n{(exc.stdout or '')[-2000:]}")
    assert res.returncode == 0, f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_algorithms_under_mpiexec(n):
    out = _mpiexec(n, os.path.join(HERE, "mpi_algorithms.py"))
    assert f"MPI-ALGORITHMS OK" in out and f"world={n}" in out, out


@pytest.mark.timeout(200)
def test_ddp_hook_through_mpi():
    out = _mpiexec(2, os.path.join(ROOT, "bench", "mpi_ddp.py"),
                   "--compressor", "qsgd:bits=8", "--algorithm", "two_phase",
                   "--compressor", "qsgd:bits=8", "--algorithm", "shared_scale",
                   "--compressor", "powersgd:rank=2", "--algorithm", "allreduce", timeout=180)
    assert out.count("replicas identical") == 3 and "mpi_ddp: OK" in out, out


@pytest.mark.timeout(200)
def test_bench_under_mpiexec():
    out = _mpiexec(3, os.path.join(ROOT, "bench", "collectives.py"), "-b", "64K", "-e", "64K",
                   "-n", "1", "-w", "1", "--compressor", "none,qsgd:bits=8",
                   "--algorithm", "two_phase,shared_scale", timeout=180)
    assert "backend mpi, 3 ranks" in out
    assert "# Out of bounds values : 0 OK" in out, out
