"""bench/ddp_step.py --netsim: one rank per shaped netsim host, launched by the bench harness
(the parent strips --netsim/-n and re-runs the script as ``--rank K`` in each host)."""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.netsim, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_ddp_step_on_two_netsim_hosts(netsim_available, tmp_path):
    cmd = [sys.executable, "bench/ddp_step.py", "--netsim", "1gbit", "-n", "2", "--width", "64",
           "--depth", "2", "--steps", "2", "--warmup", "3", "--hooks", "torch-fp16", "--no-lock",
           "--no-progress", "--no-codec", "--timeout", "200", "--out", str(tmp_path / "ns")]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world=2" in proc.stdout and "link=1gbit" in proc.stdout  # rank 0's header, via the parent
    rows = [ln.split() for ln in proc.stdout.splitlines() if ln and not ln.startswith("#")]
    # + the no-comm floor row ("no-comm floor": the model without DDP, world size 1)
    assert [r[0] for r in rows] == ["hook", "dense", "torch-fp16", "dense(again)", "no-comm"]
    assert (tmp_path / "ns.md").read_text().count("|") > 10
