"""The allgather family with variable-size payloads (size exchange first) and gloo's
reduce_scatter fallback."""

import pytest
import torch

import compressors
from comms.algorithms import allgather
from comms.transport.communicator import TorchCommunicator
from comms.cluster.launch import spawn

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


class RankSizedTopK(compressors.TopK):
    """Top-k whose k depends on the rank: payload sizes differ between ranks."""

    fixed_size = False

    def k_for(self, numel):
        return 10 + 7 * self._rank

    def compress(self, x, ctx):
        self._rank = ctx.rank
        return super().compress(x, ctx)


def _varsize(rank, world):
    comm = TorchCommunicator(None)
    comp = RankSizedTopK(0.1)
    outs = []
    for step in range(3):  # several rounds in a row: the size round must stay in order
        x = torch.randn(1000, generator=torch.Generator().manual_seed(100 * step + rank))
        ctx = compressors.Context.of(x, rank=rank, step=step)
        total, own = allgather(comm, comp, x, ctx, {}).wait()
        outs.append((x, total, own))
    return outs


def test_variable_size_allgather_sums_every_rank_exactly():
    world = 3
    res = spawn(_varsize, world, timeout=90)
    for step in range(3):
        xs = [res[r][step][0] for r in range(world)]
        expect = torch.zeros(1000)
        for r, x in enumerate(xs):  # each rank's own top-(10 + 7r), summed in rank order
            idx = torch.topk(x.abs(), 10 + 7 * r).indices
            expect.index_add_(0, idx, x[idx])
        for r in range(world):
            assert torch.equal(res[r][step][1], expect), (step, r)
            own = res[r][step][2]
            assert int(own.count_nonzero()) == 10 + 7 * r


def _reduce_scatter(rank, world):
    comm = TorchCommunicator(None)
    t = torch.arange(world * 4, dtype=torch.float32) * (rank + 1)
    return comm.reduce_scatter(t).wait()


def test_reduce_scatter_on_gloo():
    world = 3
    res = spawn(_reduce_scatter, world, timeout=60)
    full = torch.arange(world * 4, dtype=torch.float32) * sum(r + 1 for r in range(world))
    for r in range(world):
        assert torch.equal(res[r], full[4 * r: 4 * r + 4])
