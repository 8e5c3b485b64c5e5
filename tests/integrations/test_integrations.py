"""Lightning and Accelerate integrations (issue 15) on 2 CPU ranks, each in a subprocess with a
timeout: training goes through the commpress hook, and resuming from the framework's own
checkpoint ends with the parameter bits and residuals of an uninterrupted run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from comms.launch import free_port

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _run(cmd, out, timeout=900):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_lightning_strategy_trains_compressed_and_resumes_bitwise(tmp_path):
    pytest.importorskip("lightning")
    res = _run([sys.executable, str(HERE / "lightning_train.py"), str(tmp_path)], tmp_path)
    for r in res:
        assert r["compressed_a"]  # the hook ran on CPU and sent fewer bytes than dense
        assert (r["iter_a"], r["iter_b"], r["iter_c"]) == (4, 8, 8)
        assert r["saved_world"] == 2 and r["saved_iters"] == [4, 4] and r["saved_residuals"] == [1, 1]
        assert r["b_equals_c"] and r["residual_b_equals_c"] and r["a_differs_c"]
    assert res[0]["params_c"] == res[1]["params_c"]


def test_accelerate_helper_trains_compressed_and_resumes_bitwise(tmp_path):
    pytest.importorskip("accelerate")
    res = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), str(HERE / "accelerate_train.py"), str(tmp_path)], tmp_path)
    for r in res:
        assert r["world"] == 2 and r["compressed"]
        assert r["iter"] == 8 and r["resumed_iter"] == 4
        assert r["equal"] and r["residuals_equal"]
