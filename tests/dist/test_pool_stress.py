"""Many large buckets in flight at once: the reused buffers (``PayloadPool``: the algorithms'
results and scratch, the compressors' payloads, the pipelined exchange's outputs) are handed
out again while gloo's callback threads and the exchange's worker still finish earlier
buckets. A buffer handed out while something still reads it would change the bits, so each
case trains twice — pools on, and every pool replaced by fresh allocations — and the final
parameters must be bitwise equal (and equal on every rank)."""

import pytest
import torch

from comms.cluster.launch import spawn

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

# every algorithm that reuses pooled buffers, with a compressor that gives it large payloads
CASES = [("qsgd:bits=8", "allgather"), ("topk:density=0.05", "two_phase"),
         ("sign", "allgather"), ("qsgd:bits=4", "shared_scale"), ("fp16", "allreduce"),
         ("powersgd:rank=1", "allreduce")]  # its decodes deferred into the residual and the bucket
LAYERS, WIDTH, STEPS = 8, 768, 6  # 8 buckets of 590k parameters (2.4 MB, above the pool's 2 MB)


def _train(rank, world, cases, pooled):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import importlib

    import comms
    import compressors.memory as base

    # shared_scale's integer round in 5 parts per bucket, each decoded on gloo's callback thread
    importlib.import_module("comms.algorithms.shared_scale").PART_BYTES = 1 << 17

    reused = [0]
    unreferenced = base._unreferenced

    def counting(alias):  # counts the pool's hand-outs of a buffer it gave out before
        free = unreferenced(alias)
        reused[0] += bool(free)
        return free

    base._unreferenced = counting
    if not pooled:  # the reference: every pool allocates fresh memory each time
        base.PayloadPool.empty = lambda self, n, dtype, device: base.fresh_empty(n, dtype, device)
    out = {}
    for spec, algorithm in cases:
        g = torch.Generator().manual_seed(0)
        layers = []
        for _ in range(LAYERS):
            lin = nn.Linear(WIDTH, WIDTH, bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * WIDTH ** -0.5)
            layers += [lin, nn.Tanh()]
        model = DDP(nn.Sequential(*layers), bucket_cap_mb=WIDTH * WIDTH * 4 / 2 ** 20 * 1.01)
        comms.register(model, spec, algorithm=algorithm, start_iter=1, optimizer=None)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
            opt.zero_grad()
            model(x).square().mean().backward()  # 8 buckets launched as backward reaches them
            opt.step()
        out[f"{spec}@{algorithm}"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        del model, opt
    out["reused"] = reused[0]
    return out


def test_many_large_buckets_in_flight_give_the_bits_of_fresh_buffers():
    pooled = spawn(_train, 2, CASES, True, timeout=240)
    fresh = spawn(_train, 2, CASES, False, timeout=240)
    assert pooled[0]["reused"] > 0, "the pools never handed a buffer out twice: nothing stressed"
    assert fresh[0]["reused"] == 0
    for spec, algorithm in CASES:
        key = f"{spec}@{algorithm}"
        assert torch.isfinite(pooled[0][key]).all(), key
        assert torch.equal(pooled[0][key], pooled[1][key]), f"{key}: ranks differ"
        assert torch.equal(pooled[0][key], fresh[0][key]), f"{key}: pooled buffers changed the bits"
