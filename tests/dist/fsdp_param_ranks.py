"""Rank bodies for the quantized parameter all-gather tests (module level for ``spawn``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import comms
from dist.fsdp_ranks import local_shards, make_model, pinned, shard_model, steps, teacher_data
from dist.ranks import batch


def _build(world, spec, **kw):
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh)
    state = None if spec is None else comms.fsdp.register(model, spec, **pinned(spec, **kw))
    return model, state


def gathered_in_forward(model, x) -> list[torch.Tensor]:
    """The unsharded parameters every Linear computes with (read inside its forward)."""
    seen = []

    def grab(mod, _args):
        seen.extend(p.detach().clone() for p in mod.parameters(recurse=False))

    hooks = [m.register_forward_pre_hook(grab) for m in model.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def int8_after_steps(rank, world, spec, n_steps, params="int8"):
    """``n_steps`` of SGD momentum with quantized parameter all-gathers; then the parameters a
    forward computes with on every rank, the fp32 master parameters, the report."""
    model, state = _build(world, spec, params=params)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    steps(model, opt, rank, 0, n_steps, losses)
    used = gathered_in_forward(model, torch.randn(4, 32, generator=torch.Generator().manual_seed(5)))
    everyone = [None] * world
    dist.all_gather_object(everyone, [t.reshape(-1) for t in used])
    master = [p.full_tensor().detach().reshape(-1) for p in model.parameters()]
    return {"used": everyone, "master": master, "losses": losses, "report": state.report(),
            "wire": {i: (g.wire_bytes, g.dense_bytes, g.calls) for i, g in state.gather_stats.items()}}


def teacher_losses(rank, world, spec, n_steps, params="full"):
    """The teacher task (bench-like quality check), FSDP2 over all ranks; ``spec=None``:
    plain FSDP2. Returns the held-out loss every 10 steps."""
    x, y, ex, ey = teacher_data()
    model, _state = _build(world, spec, params=params)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    evals = []
    for s in range(n_steps):
        g = torch.Generator().manual_seed(10_000 + s)
        idx = torch.randint(0, x.shape[0], (16 * world,), generator=g)[rank * 16:(rank + 1) * 16]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        if (s + 1) % 10 == 0:
            with torch.no_grad():
                evals.append(float(nn.functional.cross_entropy(model(ex), ey)))
    return evals


def bad_params(rank, world):
    """A bad params= value raises ValueError naming it; the model keeps FSDP's own comms."""
    model, _ = _build(world, None)
    try:
        comms.fsdp.register(model, "sign", params="int3")
    except ValueError as exc:
        err = str(exc)
    else:
        err = None
    groups = [g for _, m in comms.fsdp.fsdp_modules(model) for g in m._get_fsdp_state()._fsdp_param_groups]
    return {"error": err, "gathers": [type(g._all_gather_comm).__name__ for g in groups],
            "scatters": [type(g._reduce_scatter_comm).__name__ for g in groups]}


def overlap_vs_synchronous(rank, world, spec, n_steps, accumulate=1):
    """The same training with the reduce-scatter overlapping backward (the default) and
    synchronous (an explicit timeout keeps every call synchronous): master shards and counts.
    ``accumulate`` backward passes per step (the later ones add into existing gradients)."""
    out = {}
    for name, kw in (("overlap", {}), ("sync", {"timeout": 600.0})):
        model, state = _build(world, spec, params="int8", **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(n_steps):
            opt.zero_grad()
            for micro in range(accumulate):
                x, y = batch(rank, step * accumulate + micro)
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[name] = {"local": local_shards(model), "deferred": state.backward_end.deferred_calls}
    return out


def bf16_parameters(rank, world, n_steps):
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16) with int8 parameter all-gathers: the
    bf16 parameters every rank computes with, and the losses."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = make_model()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    state = comms.fsdp.register(model, "sign", algorithm="scatter_reduce", params="int8")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    steps(model, opt, rank, 0, n_steps, losses)
    used = gathered_in_forward(model, torch.randn(4, 32, generator=torch.Generator().manual_seed(5)).bfloat16())
    everyone = [None] * world
    dist.all_gather_object(everyone, [t.reshape(-1) for t in used])
    return {"used": everyone, "losses": losses, "calls": sum(g.calls for g in state.gather_stats.values())}


def forward_backward_parameters(rank, world, spec, n_steps):
    """``params="auto"`` with the default algorithm through its tuning steps: per step, how many
    Linear weights the backward computed with different values than the forward (the unsharded
    parameter read in the forward pre-hook and again when its gradient is computed), whether the
    forward used the fp32 masters (the full route) or not (int8), and every rank's forward
    weights (hashed) for a cross-rank comparison."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh)
    state = comms.fsdp.register(model, spec)  # every option at its default
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    differ, full_route, digests = [], [], []
    for s in range(n_steps):
        master = [m.weight.full_tensor().detach().clone() for m in linears]
        fwd, bwd, handles = {}, {}, []

        def grab(mod, _args):
            w = mod.weight  # the unsharded parameter this step computes with
            fwd[id(mod)] = w.detach().clone()
            handles.append(w.register_hook(lambda g, w=w, k=id(mod): bwd.__setitem__(k, w.detach().clone())))

        pre = [m.register_forward_pre_hook(grab) for m in linears]
        steps(model, opt, rank, s, s + 1)
        for h in pre + handles:
            h.remove()
        differ.append(sum(not torch.equal(fwd[id(m)], bwd[id(m)]) for m in linears))
        full_route.append([torch.equal(fwd[id(m)], w) for m, w in zip(linears, master)])
        digests.append([float(fwd[id(m)].double().mul(torch.arange(fwd[id(m)].numel(), dtype=torch.float64)
                                                      .view_as(fwd[id(m)]).add(1)).sum()) for m in linears])
    everyone = [None] * world
    dist.all_gather_object(everyone, digests)
    return {"differ": differ, "full_route": full_route, "digests": everyone,
            "decision": dict(state.gather_tuner.decision), "params": state.params}
