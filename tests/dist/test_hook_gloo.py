"""The DDP hook on 2 gloo ranks: lossless == no hook; every compressor keeps replicas equal."""

import pytest
import torch

import compressors
from comms.cluster.launch import spawn
from dist.ranks import train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

CASES = [
    ("fp16", "allreduce"), ("bf16", "allreduce"), ("randomk:density=0.1", "allreduce"),
    ("randomk:density=0.1", "allgather"),
    ("topk:density=0.01", "allgather"), ("topk:density=0.05,exact=false", "allgather"),
    ("qsgd:bits=8", "allgather"), ("qsgd:bits=4", "allgather"), ("qsgd:bits=2", "allgather"),
    ("qsgd:bits=1", "allgather"), ("sign", "allgather"), ("identity", "allgather"),
]


def _lossless(rank, world):
    base = train(rank, world, None, steps=6, return_grads=True)
    hooked = train(rank, world, "identity", steps=6, algorithm="allreduce",
                   hook_kw={"start_iter": 0}, return_grads=True)
    return base, hooked


def test_identity_hook_equals_no_hook():
    for base, hooked in spawn(_lossless, 2, timeout=120):
        for g0, g1 in zip(base["grads"], hooked["grads"]):
            assert torch.equal(g0, g1)
        assert torch.equal(base["params"], hooked["params"])


def _replicas(rank, world, cases):
    return [train(rank, world, spec, steps=20, algorithm=alg) for spec, alg in cases]


@pytest.mark.parametrize("world", [2])
def test_replicas_bitwise_equal_every_compressor(world):
    results = spawn(_replicas, world, CASES, timeout=200)
    for i, (spec, alg) in enumerate(CASES):
        p0 = results[0][i]["params"]
        assert torch.isfinite(p0).all(), spec
        for r in range(1, world):
            assert torch.equal(p0, results[r][i]["params"]), f"{spec} via {alg}: rank {r} differs"
        stats = results[0][i]["stats"]
        assert stats, f"{spec}: hook never compressed"
        assert all(s["algorithm"] == alg for s in stats.values())
        c = compressors.from_spec(spec)
        if not c.lossless:
            assert all(s["wire_bytes"] < s["dense_bytes"] for s in stats.values()), spec
