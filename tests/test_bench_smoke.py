"""Fast smoke runs of the DDP benches (bench/ddp_step.py, convergence.py, sweep.py) with
tiny sizes, plus exact checks of the helpers they share (bench/_common.py)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
if BENCH not in sys.path:
    sys.path.append(BENCH)  # last: bench/compressors.py must never shadow the package

import _common  # noqa: E402
import sweep  # noqa: E402


def _run(args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def _table(out: str, first: str) -> list[list[str]]:
    lines = [ln.split() for ln in out.splitlines() if ln and not ln.startswith("#")]
    start = next(i for i, ln in enumerate(lines) if ln and ln[0] == first)
    return lines[start:]


def test_hook_configs_all_buildable():
    configs, skipped = _common.hook_configs()
    names = [c.name for c in configs]
    assert names[:4] == ["dense", "torch-fp16", "torch-psgd-r1", "torch-psgd-r4"]
    assert len(set(names)) == len(names)
    import comms

    for c in configs:
        if c.kind == "ours":  # every listed configuration builds a state without error
            comms.CompressionState(c.spec, None, algorithm=c.algorithm, error_feedback=c.error_feedback)
    # qsgd is listed in every family it supports, and the rest is accounted for as skipped
    qsgd8 = {c.algorithm for c in configs if c.spec == "qsgd:bits=8"}
    assert "allgather" in qsgd8
    assert all(isinstance(why, str) and why for _, why in skipped)


def test_filter_configs_keeps_dense_and_rejects_unknown():
    configs, _ = _common.hook_configs()
    kept = _common.filter_configs(configs, "torch-fp16")
    assert [c.name for c in kept] == ["dense", "torch-fp16"]
    with pytest.raises(ValueError, match="no-such-hook"):
        _common.filter_configs(configs, "no-such-hook")


def test_wire_byte_models_exact():
    import torch

    assert _common.dense_wire_bytes(1000, 2) == 4000
    assert _common.dense_wire_bytes(1000, 4) == 6000
    # 2048x2048 weight compresses at rank 1: (2048 + 2048) * 1 elements; the bias stays dense
    params = [torch.empty(2048, 2048), torch.empty(2048)]
    assert _common.torch_powersgd_wire_bytes(params, 1, 2) == 4 * (4096 + 2048)
    # 4x4 at rank 4 does not pass torch's min_compression_rate=2 rule: sent dense
    assert _common.torch_powersgd_wire_bytes([torch.empty(4, 4)], 4, 2) == 4 * 16


def test_rate_parsing_and_flag_stripping():
    assert sweep.rate_gbps("500mbit") == 0.5
    assert sweep.rate_gbps("10gbit") == 10.0
    with pytest.raises(ValueError, match="10gb"):
        sweep.rate_gbps("10gb")
    assert _common._strip_flags(["--netsim", "1gbit", "-n", "2", "--steps", "3", "--nprocs=4"],
                                {"--netsim": 1, "-n": 1, "--nprocs": 1}) == ["--steps", "3"]


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_ddp_step_smoke(tmp_path):
    out = _run(["bench/ddp_step.py", "-n", "2", "--width", "64", "--depth", "2", "--steps", "2",
                "--warmup", "3", "--hooks", "torch-fp16,torch-psgd-r1,qsgd8@allgather", "--no-lock",
                "--no-progress", "--out", str(tmp_path / "ds")])
    rows = _table(out, "hook")
    assert rows[0] == ["hook", "algorithm", "buckets", "step_ms", "p90_ms", "speedup", "wire_MB",
                       "wire_ratio", "codec_ms"]
    by = {r[0]: r for r in rows[1:]}
    assert set(by) == {"dense", "torch-fp16", "torch-psgd-r1", "qsgd8@allgather", "dense(again)"}
    assert float(by["dense"][5]) == 1.0 and float(by["dense"][7]) == 1.0
    assert float(by["torch-fp16"][7]) == 2.0  # half the bytes of dense, exactly
    assert by["dense"][2] == by["torch-psgd-r1"][2] == "1"  # one bucket by default
    with open(tmp_path / "ds.csv") as f:
        recs = list(csv.DictReader(f))
    dense_b = int(recs[0]["wire_bytes"])
    numel = 2 * (64 * 64 + 64)
    assert dense_b == 2 * (2 - 1) * numel * 4 // 2
    assert (tmp_path / "ds.md").read_text().count("|") > 20


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_convergence_and_sweep_smoke(tmp_path):
    out = _run(["bench/convergence.py", "-n", "2", "--tasks", "digits", "--steps", "6",
                "--eval-every", "3", "--tail", "2", "--hooks", "qsgd8@allgather", "--no-lock",
                "--no-progress", "--out", str(tmp_path / "cv")])
    rows = _table(out, "task")
    assert rows[0] == ["task", "hook", "final_loss", "ratio", "target", "ok"]
    by = {r[1]: r for r in rows[1:]}
    assert float(by["dense"][3]) == 1.0 and float(by["qsgd8@allgather"][4]) == 1.01
    assert 0.5 < float(by["qsgd8@allgather"][3]) < 2.0
    assert (tmp_path / "cv_digits.png").stat().st_size > 1000
    with open(tmp_path / "cv_curves.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r["hook"] == "dense"]
    assert steps == [0, 3, 6]

    out = _run(["bench/sweep.py", "--loopback", "--no-lock", "--width", "64", "--depth", "2",
                "--steps", "2", "--warmup", "3", "--hooks", "torch-fp16", "--out", str(tmp_path / "sw")])
    rows = _table(out, "hook")
    assert rows[0] == ["hook", "wire_MB", "unshaped", "x@unshaped"]
    assert [r[0] for r in rows[1:]] == ["dense", "torch-fp16", "dense(again)"]
    assert (tmp_path / "sw.csv").exists() and (tmp_path / "sw.md").exists()
