"""Rank bodies for the FSDP2 / HSDP option-parity tests (module level so ``spawn`` pickles them).

Every ``register`` option on both modes: optimizer pairing, warm-up, clipping, residual bound,
a parameter without a gradient, replica checks, ``auto``, and a stuck or killed peer.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import comms
from comms.fsdp import CompressedReduceScatter, FSDPCompressionState, ReplicateAllReduce
from dist.fsdp_ranks import full_params, local_shards, make_model, pinned, shard_model, steps


class SometimesUnused(nn.Module):
    """The test MLP plus an output bias that gets no gradient on odd steps."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        self.bias = nn.Parameter(torch.zeros(10))
        self.step = 0

    def forward(self, x):
        out = self.body(x)
        return out if self.step % 2 else out + self.bias


def _mesh(mode: str, world: int):
    if mode == "fsdp":
        return init_device_mesh("cpu", (world,)), None
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return mesh["shard"], mesh.get_group("replicate")


def _build(mode, world, spec, momentum=0.0, **kw):
    mesh, rg = _mesh(mode, world)
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    state = None
    if spec is not None:
        state = comms.fsdp.register(model, spec, replicate_group=rg, optimizer=opt,
                                    **pinned(spec, rg is not None, **kw))
    return model, opt, state


def _shard_unused(model: SometimesUnused, mesh):
    from torch.distributed.fsdp import fully_shard

    shard_model(model.body, mesh)
    fully_shard(model, mesh=mesh)
    return model


def pairing_and_routes(rank, world, mode):
    """Optimizer pairing, warm-up routes, clipping and replica checks on one mode."""
    out = {}
    # optimizer pairing: SGD momentum becomes the pipeline's; identity then trains as SGD momentum
    model, opt, state = _build(mode, world, "identity", momentum=0.9)
    out["opt_momentum"], out["state_momentum"] = opt.param_groups[0]["momentum"], state.momentum
    steps(model, opt, rank, 0, 6)
    out["paired"] = full_params(model)
    # the reference: the identity path with the momentum left in the optimizer (bitwise plain
    # FSDP2 / native HSDP: tests/dist/test_fsdp.py)
    mesh, rg = _mesh(mode, world)
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    comms.fsdp.register(model, "identity", replicate_group=rg)
    steps(model, opt, rank, 0, 6)
    out["plain"] = full_params(model)
    # warm-up: top-k's default ramp sends the first compressed calls dense
    model, opt, state = _build(mode, world, "topk:density=0.01", check_replicas_every=3)
    routes = []
    for s in range(8):
        steps(model, opt, rank, s, s + 1)
        routes.append(state.stats[0].algorithm)
    out["routes"], out["checks"] = routes, state.replica_guard.checks
    # clipping: every module's averaged gradient has norm <= clip_norm, so one SGD step (lr
    # 0.05, no momentum) moves the parameters by at most 0.05 * clip_norm * modules
    model, opt, state = _build(mode, world, "identity", clip_norm=1e-3)
    before = full_params(model)
    steps(model, opt, rank, 0, 1)
    out["clip_move"] = float((full_params(model) - before).norm())
    out["modules"] = len(state.modules)
    return out


def unused_parameter(rank, world, mode):
    """A parameter without a gradient on odd steps: residuals keep their layout."""
    mesh, rg = _mesh(mode, world)
    torch.manual_seed(0)
    model = _shard_unused(SometimesUnused(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = comms.fsdp.register(model, "topk:density=0.1", replicate_group=rg, optimizer=opt,
                                **pinned("topk:density=0.1", rg is not None, warmup_steps=0))
    sizes = []
    for s in range(6):
        model.step = s
        steps(model, opt, rank, s, s + 1)
        root = state.modules.index("")
        sizes.append(state.memory.residuals[root].numel())
    return {"resets": state.memory.layout_resets, "sizes": sizes, "report": state.report()}


def auto_decisions(rank, world, mode):
    """``algorithm="auto"``: every module decides, the same on every rank; replicas stay equal."""
    model, opt, state = _build(mode, world, "sign", algorithm="auto", params="auto")
    losses = []
    steps(model, opt, rank, 0, state.tuner.decide_at + 3, losses)
    dec = [state.tuner.decision.get(i) for i in range(len(state.modules))]
    if state.gather_tuner is not None:  # FSDP: the parameter all-gathers decide too
        dec += [state.gather_tuner.decision.get(i) for i in range(len(state.modules))]
    everyone = [None] * world
    dist.all_gather_object(everyone, dec)
    return {"decisions": everyone, "losses": losses, "local": local_shards(model),
            "sd": state.state_dict()["tuner"]}


def direct_bound(rank, world, bound):
    """The residual bound on both adapters, called directly: ``|r| <= bound * |x|``."""
    out = {}
    g = torch.Generator().manual_seed(rank)
    for mode in ("fsdp", "hsdp"):
        kw = {"replicate_group": dist.group.WORLD} if mode == "hsdp" else {}
        st = FSDPCompressionState("randomk:density=0.2", **pinned("randomk:density=0.2", mode == "hsdp",
                                  residual_bound=bound, warmup_steps=0, **kw))
        st.modules, st.divide_factors = ["m"], [float(world)]
        ratios = []
        for call in range(6):
            x = torch.randn(world * 40, generator=g)
            fresh = float(x.norm())
            if mode == "fsdp":
                CompressedReduceScatter(st, 0)(torch.empty(40), x, None, dist.ReduceOp.SUM)
            else:
                ReplicateAllReduce(st, 0)(x)
            ratios.append(float(st.memory.residuals[0].norm()) / fresh)
        out[mode] = ratios
    return out


def stuck_peer(rank, world, mode, how, stamp_dir):
    """The last rank stops (SIGSTOP) or dies (SIGKILL) inside backward at step 3; every
    survivor's backward must raise within the timeout with commpress's message."""
    model, opt, state = _build(mode, world, "sign", timeout=3.0)
    victim = world - 1
    armed = {"on": False}

    def fault(grad):  # on the last layer's output gradient: before its reduce-scatter
        if armed["on"] and rank == victim:
            with open(os.path.join(stamp_dir, "victim"), "w") as f:
                f.write(f"{os.getpid()} {time.time()}")
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        return grad

    def on_output(_m, _i, out):
        out.register_hook(fault)

    model[-1].register_forward_hook(on_output)
    steps(model, opt, rank, 0, 3)
    armed["on"] = True
    t0, err = time.time(), None
    try:
        steps(model, opt, rank, 3, 4)
    except Exception as exc:  # noqa: BLE001 - what the user sees is the result
        err = f"{type(exc).__name__}: {exc}"
    took = time.time() - t0
    open(os.path.join(stamp_dir, f"done{rank}"), "w").close()
    deadline = time.time() + 30
    while time.time() < deadline and len([f for f in os.listdir(stamp_dir) if f.startswith("done")]) < world - 1:
        time.sleep(0.1)  # no survivor leaves before every survivor raised on its own
    if rank == 0 and how == "stop":
        pid = int(open(os.path.join(stamp_dir, "victim")).read().split()[0])
        os.kill(pid, signal.SIGKILL)
    return {"err": err, "seconds": took}


def adam_quality(rank, world, mode, spec, steps, adam_freeze):
    """AdamW on the teacher task through FSDP/HSDP: held-out loss (mean of the last 3
    evaluations), when the variance froze, the local shards."""
    from dist.fsdp_ranks import teacher_data

    data = teacher_data()
    mesh, rg = _mesh(mode, world)
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    state = None if spec is None else comms.fsdp.register(
        model, spec, replicate_group=rg, optimizer=opt,
        **pinned(spec, rg is not None, adam_freeze=adam_freeze, warmup_steps=0))
    evals, per = [], 32
    for s in range(steps):
        g = torch.Generator().manual_seed(10_000 + s)
        idx = torch.randint(0, data[0].shape[0], (per * world,), generator=g)[rank * per:(rank + 1) * per]
        opt.zero_grad()
        nn.functional.cross_entropy(model(data[0][idx]), data[1][idx]).backward()
        opt.step()
        if s % 10 == 9:
            with torch.no_grad():
                evals.append(float(nn.functional.cross_entropy(model(data[2]), data[3])))
    adam = None if state is None or state.adam is None else state.adam.state_dict()
    return {"final": sum(evals[-3:]) / 3, "adam": adam, "local": local_shards(model)}


class WithIdle(SometimesUnused):
    """:class:`SometimesUnused` plus a parameter no step ever uses."""

    def __init__(self):
        super().__init__()
        self.idle = nn.Parameter(torch.ones(7))


def unused_under_adamw(rank, world, mode, spec):
    """AdamW with weight decay; ``bias`` gets no gradient on odd steps, ``idle`` never: per odd
    step whether ``bias`` stayed bitwise, whether ``idle`` is still its initial value, and the
    residual of the root module across an unused step (it survives: same bits)."""
    mesh, rg = _mesh(mode, world)
    if spec is None and mode == "hsdp":  # plain: native HSDP on the 2-D mesh
        mesh = mesh.get_root_mesh() if hasattr(mesh, "get_root_mesh") else mesh._get_root_mesh()
    torch.manual_seed(0)
    model = _shard_unused(WithIdle(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    state = None if spec is None else comms.fsdp.register(
        model, spec, replicate_group=rg, optimizer=opt, **pinned(spec, rg is not None, warmup_steps=0))
    kept, grads_none, memory_kept = [], [], []

    def root_memory():  # the root module holds only bias and idle: all of it unused on odd steps
        if state is None:
            return []
        i = state.modules.index("")
        return [d[i].clone() for d in (state.memory.residuals, state.memory.velocities) if i in d]

    for s in range(8):
        model.step = s
        before, mem_before = model.bias.to_local().detach().clone(), root_memory()
        steps(model, opt, rank, s, s + 1)
        if s % 2:
            kept.append(torch.equal(before, model.bias.to_local()))
            grads_none.append(model.bias.grad is None and model.idle.grad is None)
            memory_kept.append(all(torch.equal(a, b) for a, b in zip(mem_before, root_memory())))
    return {"kept": kept, "grads_none": grads_none, "memory_kept": memory_kept, "idle": torch.equal(model.idle.full_tensor(), torch.ones(7)),
            "params": full_params(model), "resets": None if state is None else state.memory.layout_resets,
            "dropped": None if state is None else state.unused.dropped}
