"""A rank of FSDP2 / HSDP training killed or stopped: the rank body for ``stuck_ranks.run_one``.

The model is ``fsdp_ranks``' MLP, sharded per layer; ``comms.fsdp.register`` with the case's
compressor and options and **no** ``timeout`` option: every bound is the process groups' own
timeout (set-up runs at a long one; the fault window shortens every group's to ``pg_timeout``
and drops the state's communicators, which read it when they are built — as if each group had
been created with the short timeout). The victim (the last rank) stops or dies at a seeded
step, ``between`` steps (before the forward) or ``mid``-step (in backward, before any
reduce-scatter of that step, or in forward between two modules' all-gathers). Each survivor
returns the step it failed in, the last step whose ``optimizer.step()`` completed, and the
error.
"""

from __future__ import annotations

import random
import time
import traceback

__all__ = ["fsdp_fault_body"]


def fsdp_fault_body(rank, world, case, how, seed, stamp_dir, pg_timeout):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import comms
    from dist.fsdp_option_ranks import _mesh
    from dist.fsdp_ranks import make_model, pinned, shard_model
    from dist.ranks import batch
    from dist.stuck_ranks import shorten_groups, stamp_and_die

    rng = random.Random(f"{seed}-{case!r}-{how}")
    kw = dict(case.kw)
    mode, point = kw.pop("mode"), case.phase
    mesh, rg = _mesh(mode, world)
    torch.manual_seed(0)
    model = shard_model(make_model(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    state = comms.fsdp.register(model, case.spec, replicate_group=rg, optimizer=opt,
                                **pinned(case.spec, rg is not None, **kw))
    victim, at_step = world - 1, rng.randint(*case.at)
    # mid-step: in backward (the output's gradient, before any reduce-scatter of the step) or
    # in forward (before the second layer runs: between two modules' all-gathers)
    in_backward = rng.random() < 0.5

    def die(step, where):
        stamp_and_die(stamp_dir, how, {"step": step, "where": where, "phase": point})

    completed = -1
    for step in range(case.steps):
        if step == case.at[0]:
            dist.barrier()  # set-up is over on every rank: the short bound applies from here
            shorten_groups(pg_timeout)
            state._comms.clear()
        x, y = batch(rank, step)
        handles = []
        if rank == victim and step == at_step:
            if point == "between":
                die(step, "before forward")
            elif in_backward:
                def arm(_m, _i, out, s=step):  # returns None: the output stays the output
                    out.register_hook(lambda g: (die(s, "in backward"), g)[1])

                handles.append(model.register_forward_hook(arm))
            else:
                handles.append(model[2].register_forward_pre_hook(lambda *_a, s=step: die(s, "in forward")))
        try:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        except Exception as exc:  # noqa: BLE001 - the expected outcome on the survivors
            return {"t": time.time(), "step": step, "completed": completed, "at": at_step,
                    "type": type(exc).__name__, "msg": str(exc), "armed": step >= case.at[0],
                    "tb": traceback.format_exc()}
        for h in handles:
            h.remove()
        completed = step
    return {"t": None, "step": None, "completed": completed, "at": at_step}
