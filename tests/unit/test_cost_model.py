"""Cost formulas, the two-point fit, planner decisions and bucket suggestions (no communication)."""

import math

import pytest
import torch

import compressors
from comms.tuning.bucket_sizes import (ddp_has_bucket_cap_mb_list, suggest_bucket_cap_mb, suggest_bucket_cap_mb_list)
from comms.transport.communicator import LocalCommunicator
from comms.tuning.cost_model import ComputeCost, CostModel, TierCost
from comms.tuning.probe import probe
from comms.tuning.planner import Planner
from comms.cluster.topology import Topology

MB = 1 << 20


def test_ring_formulas():
    t = TierCost("x", 4, alpha=1e-3, beta=1e8)
    assert t.allreduce(8e6) == pytest.approx(1e-3 + 1.5 * 8e6 / 1e8)
    assert t.allgather(1e6) == pytest.approx(1e-3 + 3 * 1e6 / 1e8)
    assert t.reduce_scatter(8e6) == pytest.approx(1e-3 + 0.75 * 8e6 / 1e8)
    assert TierCost("one", 1, 1.0, 1.0).allreduce(1e9) == 0.0


def test_fit_recovers_alpha_beta_and_survives_noise():
    true = TierCost("x", 4, 2e-3, 1.25e8)
    sizes = (16 << 10, 4 << 20)
    fit = TierCost.fit("x", 4, sizes, [true.allreduce(s) for s in sizes])
    assert fit.alpha == pytest.approx(2e-3) and fit.beta == pytest.approx(1.25e8)
    flat = TierCost.fit("x", 2, sizes, [5e-3, 4e-3])  # big op measured faster: no negative/inf
    assert flat.alpha >= 0 and math.isfinite(flat.beta) and flat.beta > 0


def _model(inter_beta, flat_beta, local=2):
    tiers = {"flat": TierCost("flat", 4, 3e-3, flat_beta),
             "intra": TierCost("intra", local, 1e-3, 2e9),
             "inter": TierCost("inter", 2, 2e-3, inter_beta)}
    compute = {"qsgd:bits=4,chunk=1024": ComputeCost(0, 2e-9, 0, 1e-9),
               "fp16": ComputeCost(0, 0.5e-9, 0, 0.5e-9)}
    return CostModel(tiers, compute, local)


def test_family_formulas_and_hierarchy():
    qsgd = compressors.from_spec("qsgd:bits=4")
    spec = qsgd.spec()
    m = _model(inter_beta=0.0625e9, flat_beta=0.125e9)
    m.compute[spec] = ComputeCost(0, 2e-9, 0, 1e-9)
    n = 25_000_000
    wire = qsgd.wire_bytes(n, torch.float32)
    flat = m.tiers["flat"]
    expect_ag = 2e-9 * n + flat.allgather(wire) + 4 * 1e-9 * n
    assert m.predict("allgather", qsgd, n) == pytest.approx(expect_ag)
    shard = n // 2
    intra, inter = m.tiers["intra"], m.tiers["inter"]
    expect_h = (intra.all_to_all(n * 4) + 2e-9 * shard + inter.allgather(qsgd.wire_bytes(shard))
                + 2 * 1e-9 * shard + intra.allgather(shard * 4))
    assert m.predict("hier_allgather", qsgd, n) == pytest.approx(expect_h)
    assert m.predict("dense", qsgd, n) == pytest.approx(flat.allreduce(4 * n))
    assert m.predict("hier_allgather", qsgd, n) < m.predict("allgather", qsgd, n) < m.predict("dense", qsgd, n)
    no_tiers = CostModel({"flat": flat})
    assert no_tiers.predict("hier_allgather", qsgd, n) == math.inf


def _planner(model, spec, **kw):
    p = Planner(compressors.from_spec(spec), cost_model=model, **kw)
    p.ready = True
    return p


def test_planner_dense_on_fast_links_compressed_on_slow():
    fp16 = "fp16"
    fast = _planner(_model(inter_beta=20e9, flat_beta=20e9), fp16)
    assert fast.choose(0, 25_000_000) == "dense"
    slow = _planner(_model(inter_beta=0.06e9, flat_beta=0.12e9), fp16)
    choice = slow.choose(0, 25_000_000)
    assert choice == "hier_allreduce"
    row = slow.plan[0]
    assert row.predicted[choice] == min(row.predicted.values())
    assert set(row.predicted) >= {"dense", "allreduce", "allgather", "hier_allreduce"}
    # small and 1-D buckets go dense whatever the model says
    assert slow.choose(1, 1000) == "dense" and "small" in slow.plan[1].reason
    assert slow.choose(2, 1_000_000, ndims=[1, 1]) == "dense"
    assert slow.choose(3, 1_000_000, ndims=[2, 1]) != "dense"
    text = str(slow.plan)
    assert "hier_allreduce" in text and "predicted ms" in text


def test_planner_same_numbers_same_plan_and_margin():
    a = _planner(_model(0.06e9, 0.12e9), "fp16")
    b = _planner(_model(0.06e9, 0.12e9), "fp16")
    sizes = [10 ** k for k in range(3, 9)]
    assert [a.choose(i, s) for i, s in enumerate(sizes)] == [b.choose(i, s) for i, s in enumerate(sizes)]
    # margin=0.99: nothing beats dense by 99%
    strict = _planner(_model(0.06e9, 0.12e9), "fp16", margin=0.99)
    assert strict.choose(0, 25_000_000) == "dense"
    only = _planner(_model(0.06e9, 0.12e9), "fp16", algorithms=["allreduce"])
    assert only.choose(0, 25_000_000) == "allreduce"
    with pytest.raises(ValueError, match="nope"):
        Planner(compressors.from_spec("fp16"), algorithms=["nope"])
    with pytest.raises(ValueError, match="margin"):
        Planner(compressors.from_spec("fp16"), margin=1.5)


def test_probe_on_one_rank_measures_compute():
    comp = compressors.from_spec("topk:density=0.01")
    m = probe(LocalCommunicator(), [comp], sizes=(1024, 65536), reps=1,
                        sample_numels=(1 << 10, 1 << 16))
    cc = m.compute[comp.spec()]
    assert cc.compress_per_element > 0 and math.isfinite(cc.compress_fixed)
    assert m.tiers["flat"].world == 1 and m.dense(10 ** 6) == 0.0
    with pytest.raises(ValueError, match="sizes"):
        probe(LocalCommunicator(), [], sizes=(10, 5))


def test_suggest_bucket_cap():
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048))  # ~32 MiB
    slow = CostModel({"flat": TierCost("flat", 4, 5e-3, 0.125e9), "inter": TierCost("inter", 2, 4e-3, 0.06e9)})
    cap = suggest_bucket_cap_mb(model, slow)
    # 0.9/0.1 * alpha * beta / (2*(1/2)) bytes on the inter tier
    assert cap == pytest.approx(9 * 4e-3 * 0.06e9 / MB, rel=1e-3)
    fast = CostModel({"flat": TierCost("flat", 2, 1e-5, 1e9)})
    assert suggest_bucket_cap_mb(model, fast) == 1.0  # min_mb floor
    huge = CostModel({"flat": TierCost("flat", 2, 1.0, 1e10)})
    total = sum(p.numel() * 4 for p in model.parameters()) / MB
    assert suggest_bucket_cap_mb(model, huge) == pytest.approx(total, rel=1e-3)  # capped at the model
    topo = Topology.from_node_names(["a", "a", "b", "b"], 0)
    assert suggest_bucket_cap_mb(model, topo) > 1.0
    with pytest.raises(ValueError, match="efficiency"):
        suggest_bucket_cap_mb(model, slow, efficiency=1.0)
    with pytest.raises(TypeError, match="CostModel"):
        suggest_bucket_cap_mb(model, "fast")
    lst = suggest_bucket_cap_mb_list(model, slow)
    if ddp_has_bucket_cap_mb_list():
        assert lst == [cap] * math.ceil(total / cap)
    else:
        assert lst is None
