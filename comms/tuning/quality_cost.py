"""What compression costs in steps, and the margin over dense the step autotuner asks for it.

A compressor that drops what error feedback returns later (a sparsifier, a low-rank or a 1-bit
code) needs more steps than dense to reach dense's loss. Time to quality, not step time, is
the measure: a compressed plan is worth locking only when its step is faster than dense's by
more than those extra steps take back, ``1 - 1 / steps``. Measured (time to dense's loss,
bench/results/time_to_quality_*.md; docs/design-notes.md, "Quality margin"):

* 25M MLP, SGD, 1 Gb/s: top-k 1% 1.29-1.31x dense's steps, PowerSGD r1 1.54x, sign 1.66x, qsgd4
  1.0x; random-k 1% had not reached dense's loss at 1.31x its steps (4.5x its loss at 10 Gb/s);
  at 10 Gb/s top-k had not reached it at 1.34x (1.74x its loss when the time ran out);
* 12.7M transformer, AdamW, 1 Gb/s (sign in Adam's momentum space): sign 1.0x, qsgd4 1.07x.

At 10 Gb/s on the MLP the compressed plans stepped 14-22% faster than dense and lost to it in
time to quality; at 1 Gb/s they step 3-4x faster and the margin does not bind. Quantizers
(qsgd, fp16, bf16) keep the base margin.

Such a compressor's trial steps cost quality too (a sparsifier's residual leaves in bursts):
the tuner tries it only where the cost model predicts it saves at least :data:`SCREEN` of the
margin of dense's measured step (:func:`screen_for`; the ``screen`` of
:class:`~comms.tuning.autotune.Autotuner`). Half: at 10 Gb/s the model put sign's saving at
4 ms where it measured 43 (of 366), PowerSGD's at 68 where it measured 84 — and a quantizer,
whose trial steps cost nothing, is never screened on such a prediction.
"""

from __future__ import annotations

__all__ = ["STEPS_FOR_DENSE_LOSS", "STEPS_FOR_DENSE_LOSS_ADAPTIVE", "SCREEN", "steps_for_dense_loss",
           "prefer_dense_for", "screen_for"]

#: compressor name -> steps to dense's loss per dense step, with SGD (measured, see above;
#: top-k's 1.4 and random-k's 2.0 are floors above the 1.34x and 1.31x they had not reached)
STEPS_FOR_DENSE_LOSS = {"topk": 1.4, "powersgd": 1.5, "sign": 1.6, "randomk": 2.0}
#: the same where the inner optimizer is Adam's family and measured otherwise
STEPS_FOR_DENSE_LOSS_ADAPTIVE = {"sign": 1.0}
#: the share of the margin a trial needs predicted before it runs (see the module docstring)
SCREEN = 0.5


def steps_for_dense_loss(compressor, adaptive: bool = False) -> float:
    """Steps ``compressor`` needs per dense step for dense's loss (1.0: none extra)."""
    name = getattr(compressor, "name", None)
    if adaptive and name in STEPS_FOR_DENSE_LOSS_ADAPTIVE:
        return STEPS_FOR_DENSE_LOSS_ADAPTIVE[name]
    return STEPS_FOR_DENSE_LOSS.get(name, 1.0)


def prefer_dense_for(compressor, adaptive: bool = False, base: float = 0.03) -> float:
    """The fraction by which a compressed plan's step must beat dense's: ``base``, or what
    the compressor's extra steps take back (``1 - 1 / steps``) when that is more."""
    return max(base, 1.0 - 1.0 / steps_for_dense_loss(compressor, adaptive))


def screen_for(compressor, adaptive: bool = False) -> float:
    """The tuner's ``screen`` for ``compressor``: :data:`SCREEN` when it needs extra steps to
    dense's loss (its trial steps cost quality), else 0 (every proposed rule is tried)."""
    return SCREEN if steps_for_dense_loss(compressor, adaptive) > 1.0 else 0.0
