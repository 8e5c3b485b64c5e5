"""Rank bodies for the outer-sync tests (module level so ``spawn`` can pickle them)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import comms
from comms.core.replicas import param_fingerprint
from dist.ranks import batch, flat_params, make_model


def _ddp(spec, **kw):
    torch.manual_seed(0)
    model = DDP(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    state = comms.register(model, spec, optimizer=opt, **kw)
    return model, opt, state


def _train(model, opt, rank, first, last, after=None):
    for s in range(first, last):
        x, y = batch(rank, s)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if after is not None:
            after(s)


def synced_at_every_sync(rank, world, spec, n_steps, kw):
    """``check_replicas_every=1``: the synced parameters compared across ranks at every sync
    (raises on a mismatch); returns the fingerprints of the anchors after every step that
    landed a fragment, and the local parameters (they differ between syncs)."""
    model, opt, state = _ddp(spec, check_replicas_every=1, **kw)
    seen = []

    def after(s):
        seen.append((s, [param_fingerprint(a).tolist() for a in state.outer.anchors], list(state.outer.syncs)))

    _train(model, opt, rank, 0, n_steps, after)
    return {"seen": seen, "local": flat_params(model.module), "syncs": list(state.outer.syncs),
            "reducer": model.require_backward_grad_sync}


def nonfinite_pseudo_gradient(rank, world, spec, kw):
    """Rank 0's parameters turn NaN after step 5 (H 4: fragment 0 is sent after step 7, landed
    ``sync_delay`` steps later). Plain SGD inside, whose state a NaN cannot poison (AdamW's
    moments would keep the NaN: the inner optimizer's state is the user's). Returns the
    anchors (as fingerprints) before that sync and after its landing, whether the anchors and
    the local parameters are finite after it and at the end, and what every rank logged."""
    import logging

    torch.manual_seed(0)
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = comms.register(model, spec, optimizer=opt, **kw)
    logged = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    logging.getLogger("comms.outer.sync").addHandler(Keep())
    snap = {}

    def after(s):
        if s == 5:
            snap["before"] = [param_fingerprint(a).tolist() for a in state.outer.anchors]
            if rank == 0:
                with torch.no_grad():
                    next(model.module.parameters()).fill_(float("nan"))
        if s == 7 + kw.get("sync_delay", 0):  # the sync sent after step 7 has landed
            snap["after"] = [param_fingerprint(a).tolist() for a in state.outer.anchors]
            snap["finite"] = (all(bool(torch.isfinite(a).all()) for a in state.outer.anchors)
                              and bool(torch.isfinite(flat_params(model.module)).all()))

    _train(model, opt, rank, 0, 14, after)
    return {**snap, "logged": logged, "syncs": list(state.outer.syncs),
            "finite_end": bool(torch.isfinite(flat_params(model.module)).all())}


def resume_mid_period(rank, world, spec, ckpt_dir, n_steps, at, kw):
    """``n_steps`` straight against ``at`` steps, a checkpoint (model, this rank's optimizer
    and commpress state), a fresh model/optimizer/state loading it, then the rest."""
    model, opt, state = _ddp(spec, **kw)
    _train(model, opt, rank, 0, n_steps)
    straight = flat_params(model.module)
    model, opt, state = _ddp(spec, **kw)
    _train(model, opt, rank, 0, at)
    in_flight = sorted(state.outer.pending)
    path = os.path.join(ckpt_dir, f"r{rank}.pt")
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "comm": state.state_dict()}, path)
    model, opt, state = _ddp(spec, **kw)
    ck = torch.load(path, weights_only=True)
    model.module.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["comm"])
    _train(model, opt, rank, at, n_steps)
    return {"straight": straight, "resumed": flat_params(model.module), "in_flight": in_flight}


def bad_options(rank, world):
    """Every bad outer-sync option raises before anything changes (no hook, no step hook)."""
    errs = {}
    cases = {
        "every0": dict(sync_every=-1), "delay": dict(sync_every=4, sync_delay=4),
        "fragments": dict(sync_every=2, sync_fragments=3), "outer": dict(sync_every=4, outer="adam"),
        "sparseloco_qsgd": dict(sync_every=4, outer="sparseloco", spec="qsgd:bits=4"),
        "lr": dict(sync_every=4, outer_lr=-1.0), "no_every": dict(sync_delay=2),
        "per_step": dict(sync_every=4, clip_norm=1.0), "freeze": dict(sync_every=4, adam_freeze=10),
        "no_optimizer": dict(sync_every=4, optimizer=None),
    }
    for name, kw in cases.items():
        kw = dict(kw)
        spec = kw.pop("spec", "sign")
        torch.manual_seed(0)
        model = DDP(make_model())
        opt = torch.optim.AdamW(model.parameters())
        kw.setdefault("optimizer", opt)
        try:
            comms.register(model, spec, **kw)
            errs[name] = None
        except (TypeError, ValueError) as exc:
            errs[name] = f"{type(exc).__name__}: {exc}"
        errs[name + ".untouched"] = getattr(model, "_commpress_state", None) is None and \
            not opt._optimizer_step_post_hooks
    return errs


def outer_fault_body(rank, world, case, how, seed, stamp_dir, pg_timeout):
    """A rank stops or dies just before a fragment's send while the others' transfers overlap
    their inner steps (``stuck_ranks.run_one`` body): every survivor must raise when it lands
    the fragment, within the process group's timeout from its send."""
    import time
    import traceback

    import torch.distributed as dist

    from dist.stuck_ranks import shorten_groups, stamp_and_die

    model, opt, state = _ddp(case.spec, **case.kw)
    victim, every = world - 1, case.kw["sync_every"]
    at = case.at[1]  # a step after which a fragment is sent (a multiple of sync_every)
    completed = -1
    for step in range(case.steps):
        if step == case.at[0]:
            dist.barrier()
            shorten_groups(pg_timeout)
            state.outer.comm.timeout = pg_timeout
        if rank == victim and step == at:
            stamp_and_die(stamp_dir, how, {"step": step, "where": "before the send", "phase": case.phase})
        try:
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        except Exception as exc:  # noqa: BLE001 - the expected outcome on the survivors
            return {"t": time.time(), "step": step, "completed": completed, "type": type(exc).__name__,
                    "msg": str(exc), "armed": step >= case.at[0], "tb": traceback.format_exc(), "every": every}
        completed = step
    return {"t": None, "step": None, "completed": completed}


def hsdp_synced_at_every_sync(rank, world, spec, n_steps, kw):
    """HSDP 2 x (world / 2) with the outer sync across the replicas, checked at every sync:
    the anchors' fingerprints after every step, and this rank's shard index."""
    from torch.distributed.device_mesh import init_device_mesh

    from dist.fsdp_ranks import make_model as fsdp_model, shard_model, steps

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = shard_model(fsdp_model(), mesh["shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = comms.fsdp.register(model, spec, replicate_group=mesh.get_group("replicate"), optimizer=opt,
                                check_replicas_every=1, **kw)
    seen = []
    for s in range(n_steps):
        steps(model, opt, rank, s, s + 1)
        seen.append([param_fingerprint(a).tolist() for a in state.outer.anchors])
    return {"seen": seen, "shard": mesh["shard"].get_local_rank(), "syncs": list(state.outer.syncs)}


def auto_switch(rank, world, n_steps, early=False, dense_s=1.25):
    """``algorithm="auto"`` with the outer sync's choice forced (loopback is fast: the real
    rule keeps compressing): the switch at a step boundary after the lock gives SGD's momentum
    back, keeps the synced parameters equal, and says so in one WARNING line. ``early``: fake
    step times make the compressed rules beat dense and only a standing leader is moved (the
    forced choice declines a locked plan): the switch ends the tuning in round 2, or in round 1
    where the compressed rules' fake step (1.0) is within three quarters of dense's (``dense_s``)."""
    import logging

    import comms.ddp.outer_switch as switch

    lines = []

    class Grab(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("comms").addHandler(Grab(level=logging.WARNING))
    def forced(planner, c, n, dt, adaptive=False, plan=None, margin=0.0):
        if early and plan is None:
            return None, "a locked plan declined by the test"
        return {"sync_every": 4, "sync_fragments": 2, "sync_delay": 1, "algorithm": "allgather"}, "forced by the test"

    switch.choose_outer = forced
    torch.manual_seed(0)
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = comms.register(model, "qsgd:bits=4", optimizer=opt)
    tuner = state.planner.tuner
    tuner.max_steps = 40 if early else 8
    if early:  # the tiny model's buckets planned, two compressed rules timed against dense
        state.planner.min_numel = 100
        tuner.candidates = ["allgather", "two_phase"]
        tuner.timing = lambda rule, s: {"dense": dense_s}.get(rule, 1.0)
    taken = opt.param_groups[0]["momentum"]
    _train(model, opt, rank, 0, n_steps)
    outer = state.outer
    return {"taken": taken, "momentum": opt.param_groups[0]["momentum"], "switched": outer is not None,
            "syncs": None if outer is None else list(outer.syncs),
            "anchors": None if outer is None else [param_fingerprint(a).tolist() for a in outer.anchors],
            "lines": [m for m in lines if "communicates every" in m], "reducer": model.require_backward_grad_sync,
            "locked": tuner.locked, "reason": tuner.reason, "tuning_steps": tuner.tuning_steps,
            "lock_lines": [m for m in lines if "autotune locked" in m]}
