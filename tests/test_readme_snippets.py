"""README's quick-start snippets run as written, on CPU with gloo, 2 processes each.

Each fenced ``python`` block of README.md and docs/frameworks.md whose first line is
``# readme-snippet: NAME`` is written to a file in a fresh folder and launched the way the docs
say: DDP, FSDP2, HSDP and the Hugging Face Trainer with ``torchrun --nproc-per-node 2``;
Lightning and Fabric with ``python FILE`` (the framework starts the second process);
Accelerate with ``accelerate launch --multi_gpu --num_processes 2``. A snippet passes when every
process exits 0 within the timeout and leaves the checkpoint files it says it writes.
README's nanoGPT recipe (``# readme-recipe: nanogpt``) is added to a script shaped like
nanoGPT's ``train.py`` (tests/integrations/nanogpt), which trains and checkpoints (its resume:
tests/integrations/test_nanogpt.py).
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from comms.cluster.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "docs" / "frameworks.md"]
TIMEOUT_S = 300

pytestmark = [pytest.mark.dist, pytest.mark.slow]

_BLOCK = re.compile(r"```python\n# readme-snippet: (\w+)\n(.*?)```", re.S)


def snippets() -> dict[str, str]:
    """``{name: source}`` of every marked python block of README.md and docs/frameworks.md."""
    out = {}
    for doc in DOCS:
        for m in _BLOCK.finditer(doc.read_text()):
            assert m.group(1) not in out, f"two snippets named {m.group(1)!r}"
            out[m.group(1)] = f"# readme-snippet: {m.group(1)}\n{m.group(2)}"
    return out


def _torchrun(f: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(free_port()), str(f)]


def _python(f: Path) -> list[str]:
    return [sys.executable, str(f)]


def _accelerate(f: Path) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), str(f)]


#: name -> (launcher, module it needs, files it must leave behind)
CASES = {
    "ddp": (_torchrun, None, ["ckpt.rank0.pt", "ckpt.rank1.pt"]),
    "fsdp": (_torchrun, None, ["ckpt_fsdp/.metadata", "ckpt_fsdp.commpress.rank0.pt",
                               "ckpt_fsdp.commpress.rank1.pt"]),
    "hsdp": (_torchrun, None, []),
    "lightning": (_python, "lightning", ["lightning.ckpt"]),
    "fabric": (_python, "lightning", ["fabric.ckpt"]),
    "accelerate": (_accelerate, "accelerate", ["accelerate_ckpt"]),
    "trainer": (_torchrun, "transformers", ["hf_out/checkpoint-20/commpress.rank0.pt",
                                            "hf_out/checkpoint-20/commpress.rank1.pt"]),
}


def test_readme_has_exactly_the_tested_snippets():
    assert sorted(snippets()) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_readme_snippet_runs_on_two_cpu_processes(name, tmp_path):
    launcher, needs, leaves = CASES[name]
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed (pip install -e '.[integrations]')")
    f = tmp_path / f"{name}_train.py"
    f.write_text(snippets()[name])
    _launch(name, lambda: launcher(f), tmp_path)
    missing = [x for x in leaves if not (tmp_path / x).exists()]
    assert not missing, f"{name} did not write {missing}"


def _launch(name: str, command, cwd: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("COMMPRESS_CPU_KERNELS", None)
    for attempt in range(2):  # a port taken between free_port() and the launch: launch again
        p = subprocess.run(command(), cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        if p.returncode == 0 or "address already in use" not in (p.stdout + p.stderr).lower():
            break
    assert p.returncode == 0, f"{name}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def test_readme_nanogpt_recipe_trains_and_checkpoints(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "nanogpt_recipe", ROOT / "tests" / "integrations" / "nanogpt" / "recipe.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    (tmp_path / "train.py").write_text(recipe.apply(recipe.recipe(README), recipe.TRAIN.read_text()))
    shutil.copy(recipe.TRAIN.with_name("model.py"), tmp_path / "model.py")
    # a checkpoint at iteration 6; resuming from it: tests/integrations/test_nanogpt.py
    _launch("nanogpt", lambda: _torchrun(tmp_path / "train.py") + ["--max_iters=7"], tmp_path)
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == \
        ["ckpt.pt", "commpress.rank0.pt", "commpress.rank1.pt"]
