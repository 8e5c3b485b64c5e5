"""Skip netsim tests where netsim cannot run (the benches say why in more detail when run)."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def netsim_available():
    # the checks bench/harness/netsim.py makes; tests do not import bench internals
    if os.geteuid() != 0:
        pytest.skip("netsim needs root (ip netns, tc)")
    if not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("netsim needs iproute2 (ip, tc)")
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        pytest.skip("ip netns is not usable here")
