"""Topology groups and the hierarchical algorithm on 4 gloo ranks faking 2 nodes (COMMPRESS_NODE)."""

import os

import pytest
import torch

import compressors
from comms.algorithms import get_algorithm
from comms.cluster.launch import spawn
from comms.cluster.topology import Topology

pytestmark = [pytest.mark.dist]

SEQUENTIAL = ["nodeA", "nodeA", "nodeB", "nodeB"]
ROUND_ROBIN = ["nodeA", "nodeB", "nodeA", "nodeB"]  # Open MPI --map-by node placement


def _groups(rank, world, names):
    os.environ["COMMPRESS_NODE"] = names[rank]
    topo = Topology.discover()
    t = torch.tensor([float(rank)])
    intra_sum = topo.intra.all_reduce(t.clone()).wait()
    inter_sum = topo.inter.all_reduce(t.clone()).wait()
    return {"nodes": topo.nodes, "local": topo.local_rank, "local_size": topo.local_size,
            "intra": float(intra_sum), "inter": float(inter_sum), "intra_rank": topo.intra.rank,
            "inter_rank": topo.inter.rank}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("names", [SEQUENTIAL, ROUND_ROBIN], ids=["sequential", "round_robin"])
def test_groups_follow_node_names(names):
    out = spawn(_groups, 4, names, timeout=90)
    nodes = [[r for r in range(4) if names[r] == n] for n in dict.fromkeys(names)]
    for r, o in enumerate(out):
        assert o["nodes"] == nodes
        node = next(n for n in nodes if r in n)
        assert o["local"] == node.index(r) == o["intra_rank"]
        assert o["local_size"] == 2
        assert o["intra"] == float(sum(node))
        peers = [n[o["local"]] for n in nodes]
        assert o["inter"] == float(sum(peers))
        assert o["inter_rank"] == peers.index(r)


def _data(rank, step, n):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, generator=g)


CASES = [("identity", "allreduce"), ("fp16", "allreduce"), ("topk:density=0.1", "allgather"),
         ("qsgd:bits=4", "allgather"), ("randomk:density=0.25", "allreduce")]


def _hier(rank, world, names, n, steps):
    os.environ["COMMPRESS_NODE"] = names[rank]
    topo = Topology.discover()
    comm = topo.communicator()
    results = []
    for spec, inner in CASES:
        comp = compressors.from_spec(spec)
        alg = get_algorithm(f"hier_{inner}")
        residual = torch.zeros(n)
        out = []
        for step in range(steps):
            x = _data(rank, step, n) / world + residual
            ctx = compressors.Context(numel=n, step=step, bucket=0, rank=rank, seed=7)
            total, own = alg(comm, comp, x, ctx, {}).wait()
            residual = x - own
            out.append({"x": x, "total": total, "own": own, "residual": residual.clone()})
        results.append(out)
    return results


@pytest.mark.timeout(150)
@pytest.mark.parametrize("names", [SEQUENTIAL, ROUND_ROBIN], ids=["sequential", "round_robin"])
def test_hierarchical_replica_identical_and_ef_conserves(names):
    n, steps = 1001, 3  # odd numel: the reduce-scatter pads
    per_rank = spawn(_hier, 4, names, n, steps, timeout=120)
    for i, (spec, inner) in enumerate(CASES):
        out = [per_rank[r][i] for r in range(4)]
        # casts sum on the wire in fp16, so decoded contributions add up only to fp16 rounding
        atol = 2e-3 if spec == "fp16" else 1e-5
        for step in range(steps):
            t0 = out[0][step]["total"]
            for r in range(1, 4):
                assert torch.equal(t0, out[r][step]["total"]), f"{spec}: rank {r} differs at step {step}"
            xs = torch.stack([o[step]["x"] for o in out]).sum(0)
            owns = torch.stack([o[step]["own"] for o in out]).sum(0)
            res = torch.stack([o[step]["residual"] for o in out]).sum(0)
            # EF: decoded contributions add up to the aggregate, residuals to what was lost
            torch.testing.assert_close(owns, t0, rtol=0, atol=atol, msg=spec)
            torch.testing.assert_close(xs - res, t0, rtol=0, atol=atol, msg=spec)
            if spec == "identity":
                torch.testing.assert_close(t0, xs, rtol=0, atol=1e-6)
                assert res.abs().max() < 1e-6
            else:
                assert res.abs().max() > 0, f"{spec}: lossy compressor left no residual"
                shard = -(-n // 2)  # each rank's residual lives only on its own shard
                for r in range(4):
                    node = [q for q in range(4) if names[q] == names[r]]
                    local = node.index(r)
                    rr = out[r][step]["residual"].clone()
                    rr[local * shard:(local + 1) * shard] = 0
                    assert torch.count_nonzero(rr) == 0, spec


def _ddp(rank, world, names, spec, mode):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import comms
    from comms.tuning.cost_model import ComputeCost, CostModel, TierCost

    os.environ["COMMPRESS_NODE"] = names[rank]
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ddp = DDP(model, bucket_cap_mb=0.01)
    if mode == "auto_slow":
        # the model's plan is what this test checks: no timed trials (autotune=False)
        state = comms.register(ddp, spec, start_iter=1, autotune=False)
        assert state.algorithm == "auto"  # the default
        # links as slow as a 100 Mb/s network: the planner must compress the big buckets
        state.planner.model = CostModel({"flat": TierCost("flat", 4, 1e-3, 12.5e6),
                                         "intra": TierCost("intra", 2, 1e-4, 5e9),
                                         "inter": TierCost("inter", 2, 1e-3, 6e6)},
                                        {state.compressor.spec(): ComputeCost()}, 2)
        state.planner.min_numel = 5000  # the bucket of the small layer and biases goes dense
    else:
        state = comms.register(ddp, spec, start_iter=1, algorithm=mode)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(6):
        gx = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 64, generator=gx), torch.randint(0, 10, (16,), generator=gx)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    plan = state.plan
    return {"params": params, "plan": [(r.bucket, r.numel, r.chosen) for r in plan] if plan else None,
            "table": str(plan) if plan else "", "algs": {b: s.algorithm for b, s in state.stats.items()},
            "dense_calls": state.dense_calls}


@pytest.mark.timeout(400)
def test_ddp_auto_and_hierarchical_replicas_equal():
    names = ROUND_ROBIN
    for spec, mode in [("fp16", "auto_slow"), ("topk:density=0.05", "hier_allgather")]:
        out = spawn(_ddp, 4, names, spec, mode, timeout=180)
        for r in range(1, 4):
            assert torch.equal(out[0]["params"], out[r]["params"]), f"{spec}/{mode}: rank {r} differs"
        assert torch.isfinite(out[0]["params"]).all()
        if mode == "auto_slow":
            plans = [o["plan"] for o in out]
            assert all(p == plans[0] for p in plans), "ranks planned differently"
            chosen = {c for _, _, c in plans[0]}
            assert "hier_allreduce" in chosen, out[0]["table"]
            assert "dense" in chosen, out[0]["table"]  # the small bucket
            assert "predicted ms" in out[0]["table"]
            assert "hier_allreduce" in out[0]["algs"].values()
        else:
            assert set(out[0]["algs"].values()) == {"hier_allgather"}
