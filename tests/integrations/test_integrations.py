"""Lightning, Fabric and Accelerate integrations on 2 CPU ranks, each in a subprocess with a
timeout: each trains like ``comms.register(ddp, spec, optimizer=opt)`` on the same model,
data order and steps (SGD momentum 0.9, top-k 1% on a pinned allgather), and resuming from the
framework's own checkpoint ends with the parameter bits and residuals of an uninterrupted run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from comms.cluster.launch import free_port

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
MISSING = "holds no commpress state while compression is on"
UNLOADED = "was not loaded before the first step"


def _run(cmd, out, timeout=180):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], p.stdout + p.stderr


def _torchrun(script, out):
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--master_port", str(free_port()), str(HERE / script), str(out)], out)


def test_lightning_strategy_trains_compressed_and_resumes_bitwise(tmp_path):
    pytest.importorskip("lightning")
    res, log = _run([sys.executable, str(HERE / "lightning_train.py"), str(tmp_path)], tmp_path)
    for r in res:
        assert r["compressed_a"]  # the hook ran on CPU and sent fewer bytes than dense
        assert (r["iter_a"], r["iter_b"], r["iter_c"]) == (4, 8, 8)
        assert r["saved_world"] == 2 and r["saved_iters"] == [4, 4] and r["saved_residuals"] == [1, 1]
        assert r["b_equals_c"] and r["residual_b_equals_c"] and r["a_differs_c"]
        assert r["momenta_c"] == [0.9, 0.0]  # taken over from configure_optimizers' SGD
        # a checkpoint without commpress state: residuals from zero, momentum set back to 0
        assert r["iter_d"] == 4 and r["momenta_d"] == [0.9, 0.0]
    assert res[0]["params_c"] == res[1]["params_c"]
    assert MISSING in log and "restored optimizer momentum [0.9]" in log
    assert UNLOADED not in log  # reported once, as a checkpoint without commpress state


def test_lightning_trains_like_register_and_logs_stats(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("sklearn")
    res, _ = _run([sys.executable, str(HERE / "lightning_equiv.py"), str(tmp_path)], tmp_path)
    for r in res:
        assert r["iter"] == 60 and r["hook_momentum"] == 0.9 and r["opt_momentum"] == 0.0
        assert abs(r["lightning"] / r["reference"] - 1) < 0.02, r
        assert r["stats"]["wire_bytes"] == 2096 and r["stats"]["dense_bytes"] == 104488
    logged = res[0]["logged"]
    assert len(logged["commpress/wire_bytes"]) == 60  # one row per step, from rank 0
    assert logged["commpress/wire_bytes"][-1] == 2096.0
    assert logged["commpress/dense_bytes"][-1] == 104488.0
    assert logged["commpress/ratio"][-1] == pytest.approx(104488 / 2096, rel=1e-6)


def test_fabric_trains_like_register_and_resumes_bitwise(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("sklearn")
    res, log = _torchrun("fabric_train.py", tmp_path)
    for r in res:
        assert r["iter"] == 60 and r["compressed"]
        assert r["hook_momentum"] == 0.9 and r["opt_momentum"] == 0.0
        assert abs(r["fabric"] / r["reference"] - 1) < 0.02, r
        assert r["resumed_iter"] == 30 and r["resume_equal"]
        assert r["plain_iter"] == 0
    assert MISSING in log


def test_accelerate_trains_like_register_with_accumulation_and_resumes_bitwise(tmp_path):
    pytest.importorskip("accelerate")
    pytest.importorskip("sklearn")
    res, log = _torchrun("accelerate_train.py", tmp_path)
    for r in res:
        assert r["world"] == 2 and r["compressed"] and r["iter"] == 60
        assert r["hook_momentum"] == 0.9 and r["opt_momentum"] == 0.0
        assert abs(r["accelerate"] / r["reference"] - 1) < 0.02, r
        assert r["resumed_iter"] == 30 and r["equal"] and r["residuals_equal"]
        assert r["plain_iter"] == 0 and r["plain_objects_back"] == 1
    assert MISSING in log


def test_trainer_one_line_compresses_like_register_and_resumes_bitwise(tmp_path):
    pytest.importorskip("transformers")
    res, log = _torchrun("trainer_train.py", tmp_path)
    for r in res:
        for opt in ("sgd", "adamw"):
            a = r[opt]
            assert a["iter"] == 12 and 0 < a["wire"] < a["dense"], a  # compressed through commpress
            assert a["files"] == ["commpress.rank0.pt", "commpress.rank1.pt"]
            assert a["logged_steps"] == 13 and a["logged_ratio"] == a["dense"] / a["wire"]
            assert r[opt + "_a_differs_initial"]
            assert r[opt + "_equal_by_hand"]   # comms.register on the same Trainer loop: same bits
            assert r[opt + "_equal_resumed"]   # resumed from checkpoint-6: same bits
            assert r[opt + "_resumed"]["iter"] == 12
        for run in ("sgd", "sgd_by_hand", "sgd_resumed", "plain"):
            assert (r[run]["hook_momentum"], r[run]["opt_momentum"]) == (0.9, 0.0), run
        assert r["adamw"]["frozen_at"] == r["adamw_resumed"]["frozen_at"] == 4
        assert r["plain"]["iter"] == 6  # no commpress state: the hook restarted from step 0
    assert MISSING in log and "(no commpress.rank1.pt)" in log
    assert UNLOADED not in log  # reported once, as a checkpoint without commpress state
    assert log.count("Adam's variance frozen after 4 dense steps") == 2  # rank 0; run and by hand


def test_lightning_with_checkpoints_and_deterministic_trains_like_register(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("sklearn")
    res, _ = _run([sys.executable, str(HERE / "lightning_parity.py"), str(tmp_path)], tmp_path)
    for r in res:
        assert r["iter"] == 72 and r["compressed"] and r["momenta"] == [0.9, 0.0]
        assert r["checkpoint_has_state"]
        assert abs(r["lightning"] / r["register"] - 1) < 0.1, r
        assert r["bitwise"]  # the same arithmetic in the same order
        assert r["register"] > r["ddp"]  # top-k 1% for 72 steps: above plain DDP's loss
    assert res[0]["lightning"] == res[1]["lightning"]
