"""``auto`` on DDP moving from every-step compression to the outer sync (communicate every H
steps), once, when :func:`comms.tuning.outer_choice.choose_outer` says the link still costs too
much of a step.

The switch happens at the first bucket of a step, when a round of the autotuner ends with a
leader that loses to the outer sync (the tuner locks it then) or at the lock: the
parameters then hold the same bits on every rank (every step so far was averaged), so they
are the outer sync's first synced parameters. What per-step compression kept is given back:
SGD's momentum returns to the optimizer (it trains locally now) with the velocity the hook kept
as each parameter's momentum buffer (:func:`velocity_to_optimizer`), Adam's momentum-space
pairing is removed, the per-step residuals are dropped; the replica check moves to the
synced parameters. From that bucket on every gradient stays local, and from the next backward
DDP's reducer is off (:func:`skip_reducer`).
"""

from __future__ import annotations

import logging

from ..outer.attach import attach_outer
from ..outer.optimizers import is_adaptive
from ..transport.notices import notice
from ..tuning.autotune_leader import leader as standing_leader, leader_margin, lock_leader
from ..tuning.outer_choice import choose_outer
from .layouts import cut

__all__ = ["maybe_switch_to_outer", "skip_reducer", "velocity_to_optimizer"]

logger = logging.getLogger(__name__)


def skip_reducer(ddp_model) -> None:
    """Turn DDP's reducer off for good, as inside ``no_sync()``: with the outer sync every
    gradient stays local, and the reducer's copies into and out of its buckets cost a quarter
    of a step on a 25M-parameter MLP (docs/design-notes.md, "Outer sync"). Gradients accumulate
    in ``.grad`` with the same values; the hook stays registered (and keeps gradients local) for
    code that turns the reducer back on; ``no_sync()`` restores this setting on exit."""
    if ddp_model is not None and hasattr(ddp_model, "require_backward_grad_sync"):
        ddp_model.require_backward_grad_sync = False


def velocity_to_optimizer(state, opt, params, world: int) -> int:
    """Hand the momentum-correction velocities to SGD as its momentum buffers: bucket ``b``'s
    velocity ``u`` (``u <- m u + g / world``, laid out as the bucket's parameters in
    ``state.layout_tracker``) becomes ``world * u`` over each parameter, the velocity of this
    rank's own gradient that SGD's ``buf <- m buf + g`` continues. Restarting the momentum
    from zero instead slows the first steps of the outer sync as a fresh start does. Per rank
    (the inner optimizer's state is local). Buckets whose layout does not match are skipped.
    Returns the number of parameters given a buffer."""
    by_key = {state.param_key(p): p for p in params}
    sizes = {k: p.numel() for k, p in by_key.items()}
    given = 0
    for index, u in state.memory.velocities.items():
        pieces = cut(state.layout_tracker.layouts.get(index, ()), u, sizes) or {}
        for k, piece in pieces.items():
            opt.state[by_key[k]]["momentum_buffer"] = piece.view_as(by_key[k]).mul(world)
        given += len(pieces)
    return given


def maybe_switch_to_outer(state, numel: int, dtype) -> bool:
    """Weigh the tuner's leader at each round's end and its locked plan once; switch when the
    outer sync wins (the decision is final then, or at the lock). Returns whether gradients now
    stay local. The same decision on every rank (agreed step times, the agreed cost model)."""
    auto = state.auto_outer
    if auto is None or state.outer is not None:
        return state.outer is not None
    tuner = state.planner.tuner if state.planner is not None else None
    if tuner is None:
        return False
    leader = None if tuner.locked else standing_leader(tuner)
    if not tuner.locked and leader is None:
        return False
    sync, why = choose_outer(state.planner, state.compressor, numel, dtype,
                             adaptive=is_adaptive(auto[0]), plan=leader, margin=leader_margin(tuner))
    comm = state.comm()
    if sync is None:
        if tuner.locked:  # decided: say so once
            state.auto_outer = None
            notice(logger, "commpress: auto keeps communicating every step: %s", why, rank=comm.rank)
        return False
    state.auto_outer = None  # decided
    if not tuner.locked:
        lock_leader(tuner, "the outer sync takes over")
        notice(logger, "commpress (step %d): %s", state.iter, tuner.lock_summary(), rank=comm.rank)
    opt, params, check_every, taken, model = auto
    if state.adam is not None:
        state.adam.remove()
        state.adam = None
    if taken is not None:
        for g in opt.param_groups:
            g["momentum"] = taken
        velocity_to_optimizer(state, opt, params, comm.world_size)
    state.memory.reset()
    state.algo_store.clear()
    state.replica_guard = None
    options = {"seed": state.seed, "timeout": state.timeout, "error_feedback": state.error_feedback}
    algorithm = sync.pop("algorithm")
    if algorithm is not None:
        options["algorithm"] = algorithm
    state.outer = attach_outer(params, comm, state.compressor, opt, sync, check_every, options)
    skip_reducer(model())  # from the next backward (this one's buckets return local gradients)
    notice(logger, "commpress: auto communicates every %d steps from step %d: %s", sync["sync_every"],
           state.iter, why, rank=comm.rank)
    return True
