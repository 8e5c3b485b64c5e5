"""``choose_outer``: whether ``auto`` communicates every H steps instead of every step, and how.

Once the step autotuner has locked its per-step plan, the measured steps and the probed cost
model say how much of a step the link still costs. The compute of a step is the measured dense
step minus the model's dense allreduce of the same bytes. When the best per-step plan still
runs more than :data:`EXPOSED` above that compute, an outer sync that hides its transfer behind
inner steps may win: ``auto`` switches to it if its predicted step — the compute plus the codec
work of a round spread over its steps — times :data:`OUTER_STEPS` (the outer sync needs more
steps to reach the same loss) beats the per-step plan by :data:`MARGIN`. Time to quality is the
measure, not the step: a faster step that needs more steps than it saves is not a win.

Its settings are the smallest that hide the transfer: a round of fragments (the whole model's
pseudo-gradient, compressed by the user's spec with the cheapest algorithm the model predicts)
takes ``t_sync`` on the link; ``H`` covers it twice over and is at least :data:`MIN_EVERY`;
four fragments (fewer when ``H`` is smaller) are synced in turn, each overlapping ``tau`` steps
— its share of ``t_sync`` in steps, plus one.
"""

from __future__ import annotations

import math

from ..algorithms import DENSE

__all__ = ["choose_outer", "EXPOSED", "MARGIN", "MIN_EVERY", "NOT_FOR_OUTER", "OUTER_STEPS"]

#: the per-step plan's step above the compute floor that counts as exposed communication
EXPOSED = 0.15
#: how much faster the outer sync's predicted step must be than the per-step plan's
MARGIN = 0.10
#: steps the outer sync needs per step of per-step compression for the same loss (time to
#: dense's loss at 1 Gb/s, H 16: 1.3-2.2x dense's steps on the 25M MLP, 1.6-2.1x on the 12.7M
#: transformer, against 1.0-1.3x for per-step compression; docs/design-notes.md, "Outer sync")
OUTER_STEPS = 1.5
#: the smallest H: at 4 and 8 the equal-step loss was worse than at 16 (docs/design-notes.md,
#: "Outer sync")
MIN_EVERY = 16
#: compressors auto never moves to the outer sync, and why: a rank-1 pseudo-gradient of a whole
#: H-step move loses what per-step PowerSGD's error feedback recovers step by step (25M MLP,
#: SGD, 1 Gb/s: auto's switch ended at 99.5x dense's loss, per-step PowerSGD reached it)
NOT_FOR_OUTER = {"powersgd": "PowerSGD's low-rank pseudo-gradients diverged under the outer sync "
                             "(docs/design-notes.md, \"Outer sync\")"}


def choose_outer(planner, compressor, numel: int, dtype) -> tuple[dict | None, str]:
    """``(sync keywords, reason)`` — ``None`` and why not, when per-step compression stays."""
    tuner, model = planner.tuner, planner.model
    if getattr(compressor, "name", None) in NOT_FOR_OUTER:
        return None, NOT_FOR_OUTER[compressor.name]
    if tuner is None or not tuner.locked or model is None or not tuner.table:
        return None, "no locked per-step plan or no cost model"
    med = {r: s for r, s, _ in tuner.table}
    dense_s, best_s = med.get(DENSE), med.get(tuner.decision)
    if not dense_s or not best_s or math.isnan(dense_s) or math.isnan(best_s):
        return None, "no step times measured"
    compute_s = max(dense_s - model.dense(numel, dtype), 0.2 * dense_s)
    if best_s <= (1 + EXPOSED) * compute_s:
        return None, (f"the per-step plan ({best_s * 1e3:.0f} ms) is within {EXPOSED:.0%} of the "
                      f"compute ({compute_s * 1e3:.0f} ms)")
    names = [a for a in planner.candidate_names() if a != DENSE]
    costs = model.candidates(compressor, numel, dtype, names)
    algorithm = min(names, key=lambda a: costs[a]) if names else DENSE
    sync_s = costs[algorithm] if names else model.dense(numel, dtype)
    codec_s = max(0.0, sync_s - model.dense(0, dtype))  # what a round costs beyond the link's latency
    every = max(MIN_EVERY, 2 * math.ceil(sync_s / compute_s))
    fragments = min(4, every)
    every = fragments * math.ceil(every / fragments)
    delay = min(every // fragments - 1, math.ceil(sync_s / fragments / compute_s) + 1)
    outer_s = compute_s + min(codec_s, sync_s) / every
    if outer_s * OUTER_STEPS * (1 + MARGIN) >= best_s:
        return None, (f"the outer sync's predicted step ({outer_s * 1e3:.0f} ms) times the "
                      f"{OUTER_STEPS:g}x steps it needs is not {MARGIN:.0%} below the per-step "
                      f"plan's ({best_s * 1e3:.0f} ms)")
    sync = {"sync_every": every, "sync_fragments": fragments, "sync_delay": max(0, delay),
            "algorithm": algorithm if algorithm != DENSE else None}
    return sync, (f"the per-step plan {tuner.decision!r} steps {best_s * 1e3:.0f} ms against "
                  f"{compute_s * 1e3:.0f} ms of compute; a round of the model's pseudo-gradients "
                  f"takes {sync_s * 1e3:.0f} ms ({algorithm}): every {every} steps, {fragments} "
                  f"fragments, {max(0, delay)} steps overlapped, predicted step {outer_s * 1e3:.0f} ms "
                  f"(x{OUTER_STEPS:g} steps)")
