"""Decisions that change training print at Python's default log level, once each, in a
script that configures no logging (2 ranks under torchrun, with a timeout)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from comms.cluster.launch import free_port

pytestmark = [pytest.mark.dist]

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def test_decisions_print_once_at_the_default_log_level():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_port", str(free_port()), str(HERE / "notice_ranks.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    lines = [line for line in log.splitlines() if "commpress" in line]
    locks = [line for line in lines if "autotune locked" in line]
    assert len(locks) == 1 and re.search(r"commpress \(step \d+\): autotune locked '\w+'", locks[0]), lines
    # after the lock, auto's choice between every step and every H steps: one line (rank 0)
    outer = [line for line in lines if "auto keeps communicating every step" in line or "communicates every" in line]
    assert len(outer) == 1, lines
    freezes = [line for line in lines if "variance frozen" in line]
    assert freezes == ["commpress: Adam's variance frozen after 3 dense steps (per-element relative change "
                       + freezes[0].split("relative change ")[1]] and "compressed from step 3" in freezes[0]
    unrestored = [line for line in lines if "was not loaded before the first step" in line]
    assert sorted(line.split(")")[0] for line in unrestored) == ["commpress (rank 0", "commpress (rank 1"]
    modules = [line for line in lines if "for FSDP module" in line]
    assert modules and len(modules) == len(set(modules)), lines  # rank 0 only, one per decision
    assert {re.search(r"FSDP module '([^']*)'", m).group(1) for m in modules} >= {"0", "2"}
    assert not any("cost model" in line for line in log.splitlines())  # INFO stays quiet
