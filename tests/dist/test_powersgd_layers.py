"""PowerSGD per layer on gloo: two allreduces per bucket with the bytes claimed, bitwise the
same aggregate on every rank, exact on low-rank layers; through DDP the hook passes the
bucket's parameter shapes and replicas stay bitwise equal."""

import math

import pytest
import torch

from comms.algorithms import ALGORITHMS
from comms.cluster.launch import spawn
from dist.ranks import train

pytestmark = [pytest.mark.dist]

SHAPES = ((64,), (64, 48), (48,), (48, 48), (64, 48), (8, 3, 4, 4), (3, 2), (48, 48))


def _direct(rank, world):
    from comms import TorchCommunicator
    from compressors import Context
    from compressors.powersgd import PowerSGD
    from dist.algo_ranks import CountingCommunicator
    from unit.test_powersgd_layers import low_rank_bucket

    out = []
    for r, data_rank in ((2, 3), (1, 2)):  # lossy: data rank above r
        c = PowerSGD(rank=r)
        xs = [low_rank_bucket(SHAPES, data_rank, seed=10 * i + r) for i in range(world)]
        comm = CountingCommunicator(TorchCommunicator())
        ctx = Context.of(xs[rank], shapes=SHAPES, rank=rank, seed=3, bucket=1)
        store = {}
        total, own = ALGORITHMS["allreduce"](comm, c, xs[rank], ctx, store).wait()
        out.append({"total": total, "own": own, "ops": comm.ops, "sent": comm.sent,
                    "claimed": 2 * (world - 1) * c.shaped_wire_bytes(SHAPES) / world,
                    "xsum": sum(xs), "q": store["powersgd_q"]})
    return out


@pytest.mark.timeout(120)
def test_per_layer_rounds_bytes_and_replicas():
    res = spawn(_direct, 2, timeout=100)
    for case in range(2):
        a, b = res[0][case], res[1][case]
        assert a["ops"] == b["ops"] == 2  # P round, Q(+uncompressed) round
        assert a["sent"] == a["claimed"]
        assert torch.equal(a["total"], b["total"])  # every rank decodes the same bits
        assert torch.equal(a["q"], b["q"])  # warm-start state identical too
        # the aggregate is the sum of the ranks' own parts (what EF subtracts)
        assert torch.allclose(a["total"], a["own"] + b["own"], atol=1e-4)
        err = float((a["total"] - a["xsum"]).norm() / a["xsum"].norm())
        assert 1e-3 < err < 1.0  # lossy (a projection never overshoots the input's norm)


def _exact_sum(rank, world):
    """Same layers' column space on both ranks: the summed matrices have rank <= r."""
    from comms import TorchCommunicator
    from compressors import Context
    from compressors.powersgd import PowerSGD

    g = torch.Generator().manual_seed(0)
    shapes = ((40, 30), (30,), (40, 30))
    left = [torch.randn(40, 2, generator=g) for _ in range(2)]  # shared P space per matrix
    xs = []
    for r in range(world):
        gr = torch.Generator().manual_seed(100 + r)
        xs.append(torch.cat([(left[0] @ torch.randn(2, 30, generator=gr)).reshape(-1),
                             torch.randn(30, generator=gr),
                             (left[1] @ torch.randn(2, 30, generator=gr)).reshape(-1)]))
    c = PowerSGD(rank=2)
    total, own = ALGORITHMS["allreduce"](TorchCommunicator(), c, xs[rank],
                                    Context.of(xs[rank], shapes=shapes, rank=rank), {}).wait()
    return total, sum(xs), xs[rank], own


@pytest.mark.timeout(120)
def test_per_layer_lossless_on_rank_r_sums():
    (t0, xsum, x0, own0), (t1, _, x1, own1) = spawn(_exact_sum, 2, timeout=100)
    assert torch.equal(t0, t1)
    assert float((t0 - xsum).norm() / xsum.norm()) < 1e-5
    assert float((own0 - x0).norm() / x0.norm()) < 1e-5  # no residual left
    assert torch.equal(t0[1200:1230], xsum[1200:1230])  # the bias went uncompressed


def _ddp(rank, world):
    import comms
    from compressors.powersgd import PowerSGD
    from dist.ranks import make_model

    shapes = [tuple(p.shape) for p in make_model().parameters()]
    res = {}
    for name, cap in (("one", 25.0), ("several", 0.01)):
        res[name] = train(rank, world, "powersgd:rank=2", steps=10, algorithm="allreduce",
                          bucket_cap_mb=cap)
    res["claimed_one"] = 2 * (world - 1) * PowerSGD(rank=2).shaped_wire_bytes(shapes) // world
    res["dense_one"] = 2 * (world - 1) * 4 * sum(math.prod(s) for s in shapes) // world
    del comms
    return res


@pytest.mark.timeout(180)
def test_ddp_per_layer_replicas_and_wire_bytes():
    res = spawn(_ddp, 2, timeout=160)
    for name in ("one", "several"):
        a, b = res[0][name], res[1][name]
        assert torch.isfinite(a["params"]).all()
        assert torch.equal(a["params"], b["params"]), name
        assert a["loss"] < 3.0
    stats = res[0]["one"]["stats"]
    assert len(stats) == 1
    (s,) = stats.values()
    # the hook passed the bucket's shapes: stats count the per-layer factors, not the flat view
    assert s["wire_bytes"] == res[0]["claimed_one"] < s["dense_bytes"] == res[0]["dense_one"]
    assert len(res[0]["several"]["stats"]) >= 1
