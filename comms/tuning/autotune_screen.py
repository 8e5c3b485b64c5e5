"""The autotuner's screen: a compressed rule the cost model cannot see winning is not tried.

Where a trial step costs quality — a compressor that needs extra steps to dense's loss
(:mod:`comms.tuning.quality_cost` sets the tuner's ``screen`` for it) — dense runs its steps
of the first round alone, the ranks agree on them (one small collective), and a compressed rule
whose predicted saving (the cost model's communication and codec per step against its dense
allreduce, :func:`comms.tuning.plan_table.predicted_saving`) falls short of ``screen`` times
the ``prefer_dense`` share of dense's measured step never runs: it could not be locked, and its
steps would put the model behind. At 10 Gb/s on the 25M MLP (SGD) random-k 1%'s trial steps
lifted the loss above the initial one and it trailed dense to the end, and top-k's cost it 10
steps to dense's loss, where both then locked dense. The rest of the first round runs the
rules left; when none is left dense is locked after dense's two steps. Those steps count even
inside the compressor's warm-up ramp (the tuner's ``count_from``, top-k's first 5 compressed
steps): they are dense steps either way.
"""

from __future__ import annotations

import math
import statistics

from ..algorithms import DENSE

__all__ = ["round_rules", "screen_rules"]


def round_rules(t) -> list[str]:
    """The rules of autotuner ``t``'s next round: dense alone while its screen is due, then the
    rest of the first round without dense (its steps ran), then every live rule."""
    if t._lead == "due":
        return [DENSE]
    if t._lead == "done" and t._rounds == 0:
        return [r for r in t._active if r != DENSE]
    return list(t._active)


def screen_rules(t, predict) -> None:
    """After dense's first-round steps of ``t`` (agreed): the compressed rules whose predicted
    saving (``predict()``: ``{rule: seconds per step}``) is under ``t.screen`` of the margin
    over dense's measured step leave the phase untried (``t.screened``); dense is locked when
    none is left. A rule with no finite prediction is tried."""
    t._lead = "done"
    dense = t._samples[DENSE]
    if not dense or predict is None:
        return  # nothing measured to weigh the predictions against: every rule is tried
    d = statistics.median(dense)
    need = t.screen * t.prefer_dense * d
    gains = predict()
    t.screened = {r: gains[r] for r in t._active
                  if r != DENSE and r in gains and math.isfinite(gains[r]) and gains[r] < need}
    t._active = [r for r in t._active if r not in t.screened]
    if len(t._active) == 1:
        t._lock([], "", reason=(
            f"no compressed rule tried: the cost model predicts at most "
            f"{max(t.screened.values()) * 1e3:.1f} ms saved per step, under {t.screen:.0%} of the "
            f"{t.prefer_dense:.0%} of dense's measured {d * 1e3:.0f} ms step a compressed plan must save"))
