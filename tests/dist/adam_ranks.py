"""Rank bodies for the Adam momentum-space tests (module level so ``spawn`` pickles them)."""

from __future__ import annotations

import copy
import math
import os

import torch
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import comms
from dist.fsdp_ranks import teacher_data
from dist.ranks import flat_params, make_model


def _setup(spec, lr=3e-3, algorithm="allgather", schedule=False, **kw):
    torch.manual_seed(0)
    model = DDP(make_model(), bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * math.cos(s / 200))
             if schedule else None)
    state = None if spec is None else comms.register(model, spec, optimizer=opt, algorithm=algorithm, **kw)
    return model, opt, state, sched


def _step(model, opt, x, y, clip=None, sched=None, reduction="mean"):
    """One training step; returns the gradient norm before clipping."""
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y, reduction=reduction)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else math.inf))
    opt.step()
    if sched is not None:
        sched.step()
    return norm


def _batch(data, rank, world, step, per_rank=32):
    xt, yt = data[0], data[1]
    g = torch.Generator().manual_seed(10_000 + step)
    idx = torch.randint(0, xt.shape[0], (per_rank * world,), generator=g)[rank * per_rank:(rank + 1) * per_rank]
    return xt[idx], yt[idx]


def quality(rank, world, spec, steps, kw):
    """Held-out loss after ``steps`` AdamW steps on the teacher task (mean of the last 3
    evaluations), and the parameters (replica identity)."""
    data = teacher_data()
    model, opt, state, _ = _setup(spec, **kw)
    evals = []
    for s in range(steps):
        _step(model, opt, *_batch(data, rank, world, s))
        if s % 10 == 9:
            with torch.no_grad():
                evals.append(float(nn.functional.cross_entropy(model.module(data[2]), data[3])))
    adam = None if state is None or state.adam is None else state.adam.state_dict()
    return {"final": sum(evals[-3:]) / 3, "params": flat_params(model.module), "adam": adam}


def _vhat(opt) -> torch.Tensor:
    parts = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            parts.append(st["exp_avg_sq"].reshape(-1) / (1 - group["betas"][1] ** float(st["step"])))
    return torch.cat(parts)


def clipped_freeze(rank, world, spec, steps):
    """A summed loss clipped to norm 1.0 every step (Hugging Face Trainer's default
    ``max_grad_norm``): the variance's total is pinned. Returns the freeze step, the gradient
    norms before clipping, and — from the optimizer state, independently of comms.core.adam — the
    relative change of the variance's total and its per-element relative change after every
    dense step."""
    data = teacher_data()
    model, opt, state, _ = _setup(spec)
    norms, totals, elems, prev = [], [], [], None
    for s in range(steps):
        frozen_before = state.adam.frozen
        norms.append(_step(model, opt, *_batch(data, rank, world, s), clip=1.0, reduction="sum"))
        if frozen_before:
            continue
        v = _vhat(opt)
        if prev is not None:
            totals.append(abs(float(v.sum()) - float(prev.sum())) / float(v.sum()))
            elems.append(float((v - prev).abs().sum() / v.sum()))
        prev = v
    return {"freeze_iter": state.adam.freeze_iter, "norms": norms, "totals": totals,
            "elems": elems, "params": flat_params(model.module)}


def auto_dense(rank, world, spec, freeze, after):
    """``auto`` whose timings make dense win (injected): the variance freezes, the trials
    compress, the tuner locks dense. From the lock step on, every step is compared with a
    plain DDP (torch's allreduce hook) + ``torch.optim.AdamW`` run started from a copy of the
    parameters, the gradient and the optimizer state taken right before AdamW's step at the
    lock. Returns per step the gradient and parameter equality, and what the run did."""
    data = teacher_data()
    # sync_every=0: the injected +10 s would otherwise move auto to the outer sync (tested apart)
    model, opt, state, _ = _setup(spec, algorithm="auto", adam_freeze=freeze, start_iter=1, sync_every=0)
    state.planner.min_numel = 100  # the tiny model's weight buckets are worth planning
    state.planner.tuner.timing = lambda rule, seconds: seconds if rule == "dense" else seconds + 10.0
    taken = {}

    def snapshot(optimizer, args, kwargs):  # runs after commpress's pre-hook (registered first)
        if "opt" not in taken and state.planner.tuner.locked:
            taken["params"] = copy.deepcopy(model.module.state_dict())
            taken["opt"] = copy.deepcopy(optimizer.state_dict())
            taken["grads"] = [p.grad.detach().clone() for p in model.parameters()]

    opt.register_step_pre_hook(snapshot)
    frozen_params, s = 0, 0
    while "opt" not in taken and s < 80:
        _step(model, opt, *_batch(data, rank, world, s))
        frozen_params = max(frozen_params, len(state.adam.vstep))  # took frozen-variance steps
        s += 1
    lock = s - 1
    torch.manual_seed(0)
    ref = DDP(make_model(), bucket_cap_mb=0.01)
    ref.register_comm_hook(None, allreduce_hook)
    ref.module.load_state_dict(taken["params"])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    ref_opt.load_state_dict(taken["opt"])
    for p, g in zip(ref.parameters(), taken["grads"]):
        p.grad = g.clone()
    ref_opt.step()  # the lock step's AdamW step from the same state and gradient
    same = [torch.equal(flat_params(ref.module), flat_params(model.module))]
    grads_dense = []
    for t in range(lock + 1, lock + 1 + after):
        x, y = _batch(data, rank, world, t)
        _step(ref, ref_opt, x, y)
        _step(model, opt, x, y)
        grads_dense.append(all(torch.equal(a.grad, b.grad) for a, b in
                               zip(ref.parameters(), model.parameters()) if a.grad is not None))
        same.append(torch.equal(flat_params(ref.module), flat_params(model.module)))
    return {"lock": lock, "decision": state.planner.tuner.decision, "frozen_params": frozen_params,
            "freeze_iter": state.adam.freeze_iter, "same": same, "grads_dense": grads_dense,
            "vstep": len(state.adam.vstep)}


def resume(rank, world, spec, ckpt_dir, saves, total, kw):
    """A run with a warm-up + cosine schedule and clipping to norm 1.0 (summed loss: always
    active), checkpointed at every step in ``saves``; then from each checkpoint a fresh model,
    optimizer, scheduler and state resumed to ``total``. Returns the straight run's
    parameters, each resumed run's, and what the straight run's variance did."""
    data = teacher_data()
    model, opt, state, sched = _setup(spec, schedule=True, **kw)
    for s in range(total):
        if s in saves:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "comm": state.state_dict()},
                       os.path.join(ckpt_dir, f"r{rank}_{s}.pt"))
        _step(model, opt, *_batch(data, rank, world, s), clip=1.0, sched=sched, reduction="sum")
    out = {"straight": flat_params(model.module), "freeze_iter": state.adam.freeze_iter,
           "refreshes": state.adam.policy.refreshes, "scale": float(state.adam.loop.scale), "resumed": {}}
    for save in saves:
        model, opt, state, sched = _setup(spec, schedule=True, **kw)
        ck = torch.load(os.path.join(ckpt_dir, f"r{rank}_{save}.pt"), weights_only=True)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        state.load_state_dict(ck["comm"])
        for s in range(save, total):
            _step(model, opt, *_batch(data, rank, world, s), clip=1.0, sched=sched, reduction="sum")
        out["resumed"][save] = flat_params(model.module)
    return out
