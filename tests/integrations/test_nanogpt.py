"""nanoGPT's ``train.py`` (``nanogpt/train.py``, shaped like the published script) with
README's nanoGPT lines added, on 2 CPU ranks under torchrun, each launch with a timeout:
AdamW with two param groups, tied weights, 2 micro-batches per rank and step
(``require_backward_grad_sync``), grad clipping, rank 0's ``ckpt.pt`` plus each rank's
commpress file. The register line gets ``algorithm="allgather"`` (on loopback ``auto``
rightly keeps dense) and ``adam_freeze=3``: the checkpoint at step 6 holds the frozen-variance
state, and compressed steps run on both sides of it."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comms.cluster.launch import free_port

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
_spec = importlib.util.spec_from_file_location("nanogpt_recipe", HERE / "nanogpt" / "recipe.py")
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)

STEPS = 12  # optimizer steps 0..11; evals and checkpoints at 0 and 6


def _script(folder: Path, drop=None) -> Path:
    """train.py with README's lines (allgather and the freeze pinned) and model.py, in ``folder``."""
    folder.mkdir()
    src = recipe.apply(recipe.recipe(ROOT / "README.md"), recipe.TRAIN.read_text(), drop=drop)
    assert "optimizer=optimizer)" in src
    pinned = 'optimizer=optimizer, algorithm="allgather", adam_freeze=3)'
    (folder / "train.py").write_text(src.replace("optimizer=optimizer)", pinned))
    shutil.copy(recipe.TRAIN.with_name("model.py"), folder / "model.py")
    return folder / "train.py"


def _launch(script: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(script), f"--out_dir={out}", *args]
    return subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=180)


def _ok(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def _report(prefix: Path, rank: int):
    return (json.loads(Path(f"{prefix}.rank{rank}.json").read_text()),
            torch.load(f"{prefix}.rank{rank}.pt", weights_only=True))


def test_nanogpt_recipe_compresses_on_the_sync_micro_step_and_resumes_bitwise(tmp_path):
    script, out = _script(tmp_path / "src"), tmp_path / "out"
    _ok(_launch(script, out, f"--report={tmp_path / 'a'}"))
    assert sorted(f.name for f in out.iterdir()) == ["ckpt.pt", "commpress.rank0.pt", "commpress.rank1.pt"]
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 6
    saved = out.with_name("saved")
    shutil.copytree(out, saved)
    _ok(_launch(script, out, "--init_from=resume", f"--report={tmp_path / 'b'}"))
    for rank in (1, 0):  # rank 0's reports stay for the last check
        a, a_params = _report(tmp_path / "a", rank)
        b, b_params = _report(tmp_path / "b", rank)
        # one compressed exchange per optimizer step (the synchronizing micro-step), not per micro-batch
        assert a["iter_num"] == b["iter_num"] == a["hook_iter"] == b["hook_iter"] == STEPS
        assert 0 < a["wire"] < a["dense"], a
        assert a["frozen_at"] == b["frozen_at"] == 3
        assert all(torch.equal(a_params[k], b_params[k]) for k in a_params)  # bitwise
        assert a["final_loss"] == b["final_loss"]

    # rank 0's state on every rank (what a commpress state inside rank 0's ckpt.pt gives): refused
    swapped = tmp_path / "swapped"
    shutil.copytree(saved, swapped)
    shutil.copy(swapped / "commpress.rank0.pt", swapped / "commpress.rank1.pt")
    p = _launch(script, swapped, "--init_from=resume")
    assert p.returncode != 0
    assert "saved by rank 0 of 2; this process is rank 1 of 2" in p.stdout + p.stderr

    # resumed without loading the commpress state: a WARNING naming what restarts
    bare = tmp_path / "bare"
    shutil.copytree(saved, bare)
    log = _ok(_launch(_script(tmp_path / "src_bare", drop="load_state_dict"), bare, "--init_from=resume",
                      f"--report={tmp_path / 'c'}"))
    assert log.count("commpress state (topk:density=0.01,exact=true) was not loaded before the first step") == 2
    c, c_params = _report(tmp_path / "c", 0)
    assert c["hook_iter"] == STEPS - 6  # the hook restarted from step 0 ...
    assert not all(torch.equal(a_params[k], c_params[k]) for k in a_params)  # ... and trained otherwise
