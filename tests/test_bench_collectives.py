"""Smoke run of bench/collectives.py (self-spawned gloo): nccl-tests header, #wrong == 0.
The bench runs as a subprocess; its size and spec parsing are checked through its output."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "collectives.py")


def test_bad_size_rejected():
    res = subprocess.run([sys.executable, BENCH, "-b", "10X"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert res.returncode == 2 and "bad size '10X'" in res.stderr


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_bench_smoke(tmp_path):
    out_json = tmp_path / "rows.json"
    cmd = [sys.executable, BENCH, "-g", "2", "-b", "64K",
           "-e", "256K", "-f", "4", "-n", "2", "-w", "1", "--compressor", "none",
           "--compressor", "qsgd:bits=8,topk:density=0.05", "--algorithm", "allgather,two_phase,shared_scale",
           "--json", str(out_json)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    header = next(l for l in lines if l.startswith("#") and "redop" in l).lstrip("#").split()
    assert header[:9] == ["size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"]
    assert header[9:] == ["compressor", "algorithm", "wire_B", "ratio", "relerr", "raw", "codec",
                          "floor_x"]
    rows = [l.split() for l in lines if l.strip() and not l.startswith("#")]
    assert len(rows) == 2 * (1 + 3 + 2)  # 2 sizes x (dense + qsgd x3 + topk x2)
    assert {int(r[0]) for r in rows} == {64 << 10, 256 << 10}  # -b 64K -e 256K -f 4
    # "qsgd:bits=8,topk:density=0.05" is two specs; "none" is the dense allreduce
    assert {r[9] for r in rows} == {"dense", "qsgd:bits=8,chunk=2048",
                                    "topk:density=0.05,exact=true"}
    for r in rows:
        assert r[2:5] == ["float", "sum", "-1"] and int(r[0]) == 4 * int(r[1])
        assert int(r[8]) == 0, r
        busbw, algbw = float(r[7]), float(r[6])
        assert abs(busbw - algbw) <= 0.0015  # 2 ranks: busbw factor 2(n-1)/n == 1
    assert "# Out of bounds values : 0 OK" in res.stdout
    data = json.loads(out_json.read_text())
    assert len(data) == len(rows) and all(d["wrong"] == 0 for d in data)
    assert {d["algorithm"] for d in data} == {"allreduce", "allgather", "two_phase", "shared_scale"}
