"""Smoke run of bench/collectives.py (self-spawned gloo): nccl-tests header, #wrong == 0."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from collectives import parse_size, split_specs  # noqa: E402


def test_parse_size_and_specs():
    assert parse_size("64K") == 65536 and parse_size("100M") == 100 << 20 and parse_size("8") == 8
    assert split_specs(["none,topk:density=0.01,exact=false", "qsgd:bits=8"]) == [
        "none", "topk:density=0.01,exact=false", "qsgd:bits=8"]


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_bench_smoke(tmp_path):
    out_json = tmp_path / "rows.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "collectives.py"), "-g", "2", "-b", "64K",
           "-e", "256K", "-f", "4", "-n", "2", "-w", "1", "--compressor", "none",
           "--compressor", "qsgd:bits=8,topk:density=0.05", "--algorithm", "allgather,two_phase,shared_scale",
           "--json", str(out_json)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    header = next(l for l in lines if l.startswith("#") and "redop" in l).lstrip("#").split()
    assert header[:9] == ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"]
    assert header[9:] == ["compressor", "algorithm", "wire_B", "ratio", "relerr"]
    rows = [l.split() for l in lines if l.strip() and not l.startswith("#")]
    assert len(rows) == 2 * (1 + 3 + 2)  # 2 sizes x (dense + qsgd x3 + topk x2)
    for r in rows:
        assert r[2:5] == ["float", "sum", "-1"] and int(r[0]) == 4 * int(r[1])
        assert int(r[8]) == 0, r
        busbw, algbw = float(r[7]), float(r[6])
        assert abs(busbw - algbw) <= 0.0015  # 2 ranks: busbw factor 2(n-1)/n == 1
    assert "# Out of bounds values : 0 OK" in res.stdout
    data = json.loads(out_json.read_text())
    assert len(data) == len(rows) and all(d["wrong"] == 0 for d in data)
    assert {d["algorithm"] for d in data} == {"allreduce", "allgather", "two_phase", "shared_scale"}
