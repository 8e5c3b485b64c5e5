"""``choose_outer``: whether ``auto`` communicates every H steps instead of every step, and how.

Once the step autotuner has a per-step plan — at each round's end from round 2 the rule that
leads (it beat dense with confidence; after round 1 one within three quarters of dense's step,
:mod:`comms.tuning.autotune_leader`), and at the lock the locked one — the measured steps and
the probed cost model say how much of a step the link still costs. A leader that loses to the
outer sync ends the tuning there: the rounds left would only separate per-step plans, with
dense's slow steps among them (on the 12.7M transformer at 1 Gb/s they cost 7.6 s of a 73 s
run to dense's loss). The compute of a step is the measured dense
step minus the model's dense allreduce of the same bytes. A dense lock stays dense (compression
did not even pay per step). When the best per-step plan still
runs more than :data:`EXPOSED` above that compute, an outer sync that hides its transfer behind
inner steps may win: ``auto`` switches to it if its predicted step — the compute less DDP's
reducer copies (:data:`REDUCER_PASSES`), plus a round's codec work and its
:data:`OUTER_PASSES` local passes spread over its steps (not the round's link time: the
overlapped steps hide it) — times the extra steps the outer sync needs for the same
loss (:data:`OUTER_STEPS`, :data:`OUTER_STEPS_ADAPTIVE`) beats the per-step plan (by
:data:`MARGIN`). Time to quality is the measure: a faster step that needs more steps than it
saves is not a win.

Its settings are the smallest that hide the transfer: a round of fragments (the whole model's
pseudo-gradient, compressed by the user's spec with the algorithm the tuner locked, else the cheapest the model predicts)
takes ``t_sync`` on the link; ``H`` covers it twice over and is at least :data:`MIN_EVERY`;
four fragments (at most ``H / 2``) are synced in turn, each overlapping ``tau`` steps
— its share of ``t_sync`` in steps, plus one, below the fragment's share of ``H``.
"""

from __future__ import annotations

import math

from ..algorithms import DENSE
from .cost_model import HOOK_PASSES

__all__ = ["choose_outer", "EXPOSED", "MARGIN", "MIN_EVERY", "NOT_FOR_OUTER", "OUTER_PASSES",
           "OUTER_STEPS", "OUTER_STEPS_ADAPTIVE", "REDUCER_PASSES"]

#: the per-step plan's step above the compute floor that counts as exposed communication
EXPOSED = 0.15
#: how much faster the outer sync's predicted step must be than the per-step plan's: none
#: beyond its extra steps, as the prediction errs slow (it ran 4-18% above the measured outer
#: steps on the 12.7M transformer and 37% above on the 25M MLP)
MARGIN = 0.0
#: steps the outer sync (plain average, H 4) needs per step of per-step compression for the same
#: loss, SGD inside: dense's loss at 1.2-1.3x dense's steps on the 25M MLP, where per-step
#: compression needs 1.0-1.3x (docs/design-notes.md, "Outer sync")
OUTER_STEPS = 1.3
#: the same under an adaptive inner optimizer (Adam's family): on the 12.7M transformer with
#: AdamW the outer sync and per-step qsgd4 reached dense's loss at the same step in two runs
#: (1.07x dense's), 1.0x dense's at equal steps
OUTER_STEPS_ADAPTIVE = 1.05
#: local passes over a round's parameters that the outer sync adds to the engine's (holding the
#: parameters, the pseudo-gradient, the finite check, the outer step, the local move, all in
#: buffers kept from sync to sync); with the probed pass cost and :data:`REDUCER_PASSES` they
#: predict its measured 46 ms a step over the no-communication step on the 25M MLP at H 4
OUTER_PASSES = 1
#: local passes per step that a DDP step pays and the outer sync does not: the reducer's copies
#: into and out of its buckets (off while gradients stay local; 25-40 ms a step on the 25M MLP)
REDUCER_PASSES = 1
#: the smallest H: with the plain average the loss at equal steps rose with H (4 best of 4, 8,
#: 16 on both tasks; docs/design-notes.md, "Outer sync")
MIN_EVERY = 4
#: compressors auto never moves to the outer sync, and why: a rank-1 pseudo-gradient of a whole
#: H-step move loses what per-step PowerSGD's error feedback recovers step by step (25M MLP,
#: SGD, 1 Gb/s: auto's switch ended at 99.5x dense's loss, per-step PowerSGD reached it)
NOT_FOR_OUTER = {"powersgd": "PowerSGD's low-rank pseudo-gradients diverged under the outer sync "
                             "(docs/design-notes.md, \"Outer sync\")"}


def choose_outer(planner, compressor, numel: int, dtype, adaptive: bool = False,
                 plan: tuple[str, list] | None = None, margin: float = MARGIN) -> tuple[dict | None, str]:
    """``(sync keywords, reason)`` — ``None`` and why not, when per-step compression stays.
    ``adaptive``: the inner optimizer is Adam's family (:func:`comms.outer.optimizers.is_adaptive`).
    ``plan``: ``(rule, table)`` of the per-step plan to weigh (the tuner's standing leader,
    :func:`comms.tuning.autotune_leader.leader`); default: the tuner's locked plan. ``margin``:
    how much faster the outer sync's predicted step (times its extra steps) must be
    (:func:`comms.tuning.autotune_leader.leader_margin` for a standing leader)."""
    tuner, model = planner.tuner, planner.model
    if getattr(compressor, "name", None) in NOT_FOR_OUTER:
        return None, NOT_FOR_OUTER[compressor.name]
    if plan is None and tuner is not None and tuner.locked:
        plan = tuner.decision, tuner.table
    if plan is None or model is None or not plan[1]:
        return None, "no locked per-step plan or no cost model"
    decision, table = plan
    if decision == DENSE:  # compression could not beat dense per step: the link is not
        # the bottleneck the outer sync trades quality for (10 Gb/s, 25M MLP: from dense it
        # stepped 252 ms against the 196 predicted and lost to dense)
        return None, "the per-step plan is dense: the link does not cost enough to sync less often"
    med = {r: s for r, s, _ in table}
    dense_s, best_s = med.get(DENSE), med.get(decision)
    if not dense_s or not best_s or math.isnan(dense_s) or math.isnan(best_s):
        return None, "no step times measured"
    compute_s = max(dense_s - model.dense(numel, dtype), 0.2 * dense_s)
    if best_s <= (1 + EXPOSED) * compute_s:
        return None, (f"the per-step plan ({best_s * 1e3:.0f} ms) is within {EXPOSED:.0%} of the "
                      f"compute ({compute_s * 1e3:.0f} ms)")
    names = [a for a in planner.candidate_names() if a != DENSE]
    costs = model.candidates(compressor, numel, dtype, names)
    # the algorithm the tuner locked and timed, else the cheapest the model predicts (a plan
    # of per-bucket choices, "model")
    algorithm = (decision if decision in names
                 else min(names, key=lambda a: costs[a]) if names else DENSE)
    sync_s = costs[algorithm] if names else model.dense(numel, dtype)
    pass_s = getattr(model, "mem_per_element", 0.0) * numel
    # what a round costs this rank's steps: the engine's encodes, decodes and passes and the
    # outer sync's own passes; not the link time, which the overlapped steps hide (tau covers
    # a fragment's transfer)
    local_s = model.codec_seconds(algorithm, compressor, numel, dtype) if names else 0.0
    codec_s = local_s + (HOOK_PASSES + OUTER_PASSES) * pass_s
    extra = OUTER_STEPS_ADAPTIVE if adaptive else OUTER_STEPS
    every = max(MIN_EVERY, 2 * math.ceil(sync_s / compute_s))
    fragments = min(4, every // 2)
    every = fragments * math.ceil(every / fragments)
    delay = min(every // fragments - 1, math.ceil(sync_s / fragments / compute_s) + 1)
    outer_s = max(compute_s - REDUCER_PASSES * pass_s, 0.2 * dense_s) + codec_s / every
    if outer_s * extra * (1 + margin) >= best_s:
        return None, (f"the outer sync's predicted step ({outer_s * 1e3:.0f} ms) times the "
                      f"{extra:g}x steps it needs is not below the per-step plan's "
                      f"({best_s * 1e3:.0f} ms)" + (f" by {margin:.0%}" if margin else ""))
    sync = {"sync_every": every, "sync_fragments": fragments, "sync_delay": max(0, delay),
            "algorithm": algorithm if algorithm != DENSE else None}
    return sync, (f"the per-step plan {decision!r} steps {best_s * 1e3:.0f} ms against "
                  f"{compute_s * 1e3:.0f} ms of compute; a round of the model's pseudo-gradients "
                  f"takes {sync_s * 1e3:.0f} ms ({algorithm}): every {every} steps, {fragments} "
                  f"fragments, {max(0, delay)} steps overlapped, predicted step {outer_s * 1e3:.0f} ms "
                  f"(x{extra:g} steps)")
