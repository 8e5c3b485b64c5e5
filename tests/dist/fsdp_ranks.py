"""Rank bodies for the FSDP2 / HSDP gloo tests (module level so ``spawn`` can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import comms
import compressors
from dist.ranks import batch

SPECS = ["fp16", "bf16", "qsgd:bits=4", "sign", "topk:density=0.1", "randomk:density=0.2"]


def pinned(spec, replicated: bool = False, **kw) -> dict:
    """``kw`` with an algorithm that compresses every call (on loopback ``auto`` rightly
    times dense as faster): FSDP's scatter-reduce, or the compressor's first flat HSDP
    algorithm; the parameter all-gather stays full precision unless ``kw`` says otherwise."""
    from comms.fsdp.state import HSDP_ALGORITHMS, SCATTER_REDUCE

    if "algorithm" not in kw:
        c = compressors.from_spec(spec) if isinstance(spec, str) else spec
        kw["algorithm"] = SCATTER_REDUCE if not replicated else next(
            a for a in HSDP_ALGORITHMS if c is not None and c.supports(a))
    kw.setdefault("params", "full")
    return kw


def make_model(seed=0):
    """An MLP whose layers' dim 0 (64, 64, 10) exercise FSDP's padding at 4 shards."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def shard_model(model, mesh):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_shards(model) -> torch.Tensor:
    return torch.cat([p.to_local().detach().reshape(-1).clone() for p in model.parameters()])


def full_params(model) -> torch.Tensor:
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def set_local_shards_(model, flat: torch.Tensor) -> None:
    off = 0
    with torch.no_grad():
        for p in model.parameters():
            t = p.to_local()
            t.copy_(flat[off: off + t.numel()].view_as(t))
            off += t.numel()


def steps(model, opt, rank, first, last, losses=None):
    for step in range(first, last):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(loss.item())


def fsdp_run(rank, world, spec, n_steps=20, momentum=0.9, **kw):
    """FSDP2 on a 1-D mesh; ``spec=None``: plain FSDP2. Returns full params, shards, losses."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh)
    state = comms.fsdp.register(model, spec, **pinned(spec, **kw)) if spec is not None else None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    losses = []
    steps(model, opt, rank, 0, n_steps, losses)
    return {"full": full_params(model), "local": local_shards(model), "losses": losses,
            "report": state.report() if state else "", "nonfinite": state.nonfinite_modules if state else 0,
            "residual_bytes": state.residual_bytes() if state else 0}


def identity_vs_plain(rank, world):
    return fsdp_run(rank, world, None), fsdp_run(rank, world, "identity")


def identity_defaults_vs_plain(rank, world, n_steps):
    """``register(model, "identity")`` with every default against plain FSDP2 (1-D mesh), or
    with a replicate group against torch's native HSDP (2 x world/2 mesh at 4 ranks)."""
    hsdp = world == 4
    out = []
    for plain in (True, False):
        if hsdp:
            mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            mesh, rg = (mesh2 if plain else mesh2["shard"]), mesh2.get_group("replicate")
        else:
            mesh, rg = init_device_mesh("cpu", (world,)), None
        torch.manual_seed(0)
        model = shard_model(make_model(), mesh)
        if not plain:
            comms.fsdp.register(model, "identity", replicate_group=rg)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        steps(model, opt, rank, 0, n_steps, losses)
        out.append({"local": local_shards(model), "losses": losses})
    return out


def compressed_runs(rank, world, specs):
    return {s: (fsdp_run(rank, world, s), fsdp_run(rank, world, s)) for s in specs}


def hsdp_run(rank, world, spec, n_steps=10, native=False, **kw):
    """4 ranks as (replicate=2, shard=2). ``native``: torch's own HSDP on the 2-D mesh
    (dense); else 1-D FSDP over the shard dim plus our replicate all-reduce (``spec``)."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh if native else mesh["shard"])
    state = None
    if not native:
        state = comms.fsdp.register(model, spec, replicate_group=mesh.get_group("replicate"),
                                    **pinned(spec, True, **kw))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    steps(model, opt, rank, 0, n_steps, losses)
    return {"local": local_shards(model), "losses": losses, "shard_rank": mesh["shard"].get_local_rank(),
            "replicate_rank": mesh["replicate"].get_local_rank(),
            "report": state.report() if state else "", "residual_bytes": state.residual_bytes() if state else 0}


def hsdp_cases(rank, world, specs):
    out = {"native": hsdp_run(rank, world, None, native=True), "identity": hsdp_run(rank, world, "identity")}
    for s in specs:
        out[s] = hsdp_run(rank, world, s)
    return out


def resume_run(rank, world, spec, ckpt_dir, **kw):
    """10 steps straight vs 5 steps + checkpoint (weights_only) + fresh model/state + 5 steps.
    Plain SGD (no momentum): the parameters and the commpress state are the whole state."""
    import os

    straight = fsdp_run(rank, world, spec, n_steps=10, momentum=0.0, **kw)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh)
    state = comms.fsdp.register(model, spec, **pinned(spec, **kw))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps(model, opt, rank, 0, 5)
    path = os.path.join(ckpt_dir, f"fsdp.rank{rank}.pt")
    torch.save({"shards": local_shards(model), "comm": state.state_dict()}, path)
    del model, state, opt
    ck = torch.load(path, weights_only=True)
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    model = shard_model(make_model(seed=7), mesh)
    state = comms.fsdp.register(model, spec, **pinned(spec, **kw))
    state.load_state_dict(ck["comm"])
    set_local_shards_(model, ck["shards"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps(model, opt, rank, 5, 10)
    return {"straight": straight["local"], "resumed": local_shards(model),
            "residual_modules": sorted(ck["comm"]["memory"]["residuals"]), "steps": ck["comm"]["steps"],
            "params": ck["comm"]["params"]}


def direct_calls(rank, world):
    """Call the module reduce-scatter directly: values vs closed forms, EF identity, NaN guard."""
    from comms.fsdp import CompressedReduceScatter, FSDPCompressionState

    out = {}
    g = torch.Generator().manual_seed(rank)
    m = 37  # shard numel (odd on purpose)
    xs = [torch.randn(world * m, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    for spec in ("identity", "fp16", "topk:density=0.2"):
        st = FSDPCompressionState(spec, warmup_steps=0, algorithm="scatter_reduce")  # compressed from the first call
        st.modules = ["m"]
        rs = CompressedReduceScatter(st, 0)
        x = xs[rank].clone()
        y = rs.allocate((m,), dtype=torch.float32, device="cpu")
        rs(y, x, None, dist.ReduceOp.SUM)
        y_avg = rs.allocate((m,), dtype=torch.float32, device="cpu")
        x2 = xs[rank].clone()
        rs(y_avg, x2, None, dist.ReduceOp.AVG)
        res = st.memory.residuals.get(0)
        out[spec] = {"out": y.clone(), "avg": y_avg.clone(), "residual": None if res is None else res.clone(),
                     "ef_input": x2.clone()}
    # non-finite on rank 1 only, at the second call
    st = FSDPCompressionState("topk:density=0.2", warmup_steps=0, algorithm="scatter_reduce")
    st.modules = ["m"]
    rs = CompressedReduceScatter(st, 0)
    outs = []
    for call in range(3):
        x = torch.randn(world * m, generator=g)
        if call == 1 and rank == 1:
            x[5] = float("inf")
        y = torch.empty(m)
        rs(y, x, None, dist.ReduceOp.SUM)
        outs.append((y.clone(), st.memory.residuals[0].clone()))
    out["nan"] = {"outs": outs, "count": st.nonfinite_modules}
    out["xs"] = xs
    return out


def error_cases(rank, world):
    """Every bad input raises before any module is changed."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    mesh = init_device_mesh("cpu", (world,))
    errs = {}

    def expect(name, fn):
        try:
            fn()
            errs[name] = None
        except (TypeError, ValueError) as exc:
            errs[name] = f"{type(exc).__name__}: {exc}"

    model = shard_model(make_model(), mesh)
    before = [type(g._reduce_scatter_comm).__name__ for _, mm in comms.fsdp.fsdp_modules(model)
              for g in mm._get_fsdp_state()._fsdp_param_groups]
    expect("powersgd", lambda: comms.fsdp.register(model, "powersgd:rank=1"))
    expect("bad_spec", lambda: comms.fsdp.register(model, "topk:density=2"))
    expect("algorithm_in_fsdp_mode", lambda: comms.fsdp.register(model, "sign", algorithm="allgather"))
    expect("mesh_as_group", lambda: comms.fsdp.register(model, "sign", replicate_group=mesh))
    expect("plain_module", lambda: comms.fsdp.register(make_model(), "sign"))
    # an optimizer of another model: its momentum would be zeroed and the hook's applied here
    foreign = torch.optim.SGD(make_model(1).parameters(), lr=0.1, momentum=0.9)
    expect("foreign_optimizer", lambda: comms.fsdp.register(model, "sign", optimizer=foreign))
    errs["foreign_momentum"] = foreign.param_groups[0]["momentum"]  # untouched
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    expect("adam_freeze_sgd", lambda: comms.fsdp.register(model, "topk:density=0.1", optimizer=sgd,
                                                          adam_freeze=20))
    errs["sgd_momentum"] = sgd.param_groups[0]["momentum"]  # untouched
    adamw = torch.optim.AdamW(model.parameters())
    expect("adam_freeze_qsgd", lambda: comms.fsdp.register(model, "qsgd:bits=4", optimizer=adamw,
                                                           adam_freeze="auto"))
    expect("adam_freeze_no_optimizer", lambda: comms.fsdp.register(model, "topk:density=0.1", adam_freeze=10))
    rg = dist.new_group(list(range(world)))
    expect("hsdp_powersgd", lambda: comms.fsdp.register(model, "powersgd:rank=1", replicate_group=rg))
    # FSDP1 needs an accelerator to construct; the check only looks at the type
    fake1 = FSDP1.__new__(FSDP1)
    nn.Module.__init__(fake1)
    expect("fsdp1", lambda: comms.fsdp.register(fake1, "sign"))
    # several parameter groups: biases on a mesh of their own process group
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    mesh2 = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")
    info2 = FSDPMeshInfo(mesh2, shard_mesh_dim=0)
    multi = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(multi[0], mesh=mesh)
    fully_shard(multi, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), info2)
                if p.ndim == 1 else None)
    errs["groups"] = len(multi._get_fsdp_state()._fsdp_param_groups)
    expect("multi_group", lambda: comms.fsdp.register(multi, "sign"))
    multi_first = type(multi[0]._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm).__name__
    after = [type(g._reduce_scatter_comm).__name__ for _, mm in comms.fsdp.fsdp_modules(model)
             for g in mm._get_fsdp_state()._fsdp_param_groups]
    comms.fsdp.register(model, "sign")
    expect("twice", lambda: comms.fsdp.register(model, "sign"))
    final = [type(g._reduce_scatter_comm).__name__ for _, mm in comms.fsdp.fsdp_modules(model)
             for g in mm._get_fsdp_state()._fsdp_param_groups]
    return {"errs": errs, "before": before, "after": after, "multi_first": multi_first, "final": final}


def config_mismatch(rank, world):
    """Rank 1 uses another seed: every rank raises ValueError naming the field, before data moves."""
    from comms.fsdp import CompressedReduceScatter, FSDPCompressionState

    st = FSDPCompressionState("sign", seed=rank, algorithm="scatter_reduce")
    st.modules = ["layer"]
    rs = CompressedReduceScatter(st, 0)
    x = torch.randn(world * 8)
    try:
        rs(torch.empty(8), x, None, dist.ReduceOp.SUM)
    except ValueError as exc:
        return {"error": str(exc), "steps": dict(st.steps), "residuals": len(st.memory.residuals)}
    return {"error": None}


def teacher_data(n_train=2048, n_eval=512):
    """A learnable task for the convergence tests: labels from a fixed random teacher MLP."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n_train + n_eval, 32, generator=g)
    teacher = make_model(seed=12)
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(8.0)  # sharper logits than the students' init: a target worth learning
        y = teacher(x).argmax(1)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def hsdp_train_eval(rank, world, spec, n_steps, data, native=False, lr=0.05, **kw):
    """HSDP 2 x (world/2) on the teacher task (SGD momentum 0.9, batch 16 per rank, each rank
    its own slice of the same global batch); returns held-out losses and the local shards."""
    x, y, ex, ey = data
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh if native else mesh["shard"])
    state = None
    if not native:
        state = comms.fsdp.register(model, spec, replicate_group=mesh.get_group("replicate"),
                                    **pinned(spec, True, **kw))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    evals = []
    for step in range(n_steps):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(step))
        idx = perm[rank * 16:(rank + 1) * 16]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        if (step + 1) % 10 == 0:
            with torch.no_grad():
                evals.append(float(nn.functional.cross_entropy(model(ex), ey)))
    model.reshard()
    return {"evals": evals, "local": local_shards(model), "shard_rank": mesh["shard"].get_local_rank(),
            "nonfinite": state.nonfinite_modules if state else 0}


def hsdp_convergence(rank, world, specs, n_steps):
    data = teacher_data()
    out = {"dense": hsdp_train_eval(rank, world, None, n_steps, data, native=True)}
    for s in specs:
        out[s] = hsdp_train_eval(rank, world, s, n_steps, data, start_iter=2)
    return out
