"""The ``auto`` planner's per-bucket rows and ``state.plan``, the table of them.

A bucket's row is decided once from the cost model (:func:`decide_row`: every candidate's
predicted time, the cheapest, or why the bucket stays dense); what a whole-step rule runs for
it follows from the row alone (:func:`apply_rule`). ``str(state.plan)`` prints one row per
bucket (its size, what it runs now, every candidate's predicted time, why), then the
autotuner's trial table, the model's predicted step time beyond dense next to the measured
one for each tried rule, the topology and the cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from ..algorithms import DENSE
from .autotune import MODEL, Autotuner
from .cost_model import CostModel

__all__ = ["Plan", "PlanRow", "decide_row", "apply_rule", "predicted_saving"]


@dataclass
class PlanRow:
    bucket: int
    numel: int
    dtype: torch.dtype
    nbytes: int
    chosen: str  # what the bucket runs now (under the autotuner's rule)
    reason: str
    predicted: dict = field(default_factory=dict)  # candidate -> seconds
    model_choice: str = ""  # the cost model's own pick (``chosen`` without a tuner)


def decide_row(model: CostModel | None, compressor, bucket: int, numel: int, dtype: torch.dtype,
               ndims: Sequence[int] | None, candidates: Sequence[str], min_numel: int,
               margin: float) -> PlanRow:
    """The row of one bucket: every candidate's predicted time and the cost model's pick —
    the cheapest compressed candidate when it beats dense by ``margin`` (ties keep the earlier
    candidate), else dense; small buckets (``< min_numel``) and buckets of only 1-D tensors
    (``ndims``) stay dense whatever the model says."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    row = PlanRow(bucket, numel, dtype, nbytes, DENSE, "cheapest")
    if model is None:
        row.reason = "no cost model (one rank or not set up)"
        return row
    row.predicted = model.candidates(compressor, numel, dtype, candidates)
    if numel < min_numel:
        row.reason = f"small (< {min_numel} elements)"
        return row
    if ndims is not None and len(ndims) and max(ndims) <= 1:
        row.reason = "1-D tensors only"
        return row
    dense_t = row.predicted[DENSE]
    best, best_t = DENSE, dense_t
    for name, t in row.predicted.items():  # insertion order: ties keep the earlier one
        if name != DENSE and t < best_t and t < dense_t * (1 - margin):
            best, best_t = name, t
    row.chosen = best
    return row


def apply_rule(rule: str, row: PlanRow) -> str:
    """What the whole-step ``rule`` runs for the bucket of ``row``: the model's pick under
    ``"model"``; the rule's algorithm where the bucket is planned and it is a candidate; else
    dense (small, 1-D and unplanned buckets stay dense under every rule)."""
    if rule == MODEL:
        return row.chosen
    if rule == DENSE or row.reason != "cheapest" or rule not in row.predicted:
        return DENSE  # small, 1-D, unplanned buckets, or not a candidate here
    return rule


def predicted_saving(rows: Sequence[PlanRow], rule: str) -> float:
    """Seconds per step the cost model predicts the whole-step ``rule`` saves against
    all-dense over the buckets of ``rows`` (negative: slower); ``nan`` when a row has no
    prediction. Communication and codec only: what the rule cannot change is the same."""
    total = 0.0
    for r in rows:
        if DENSE not in r.predicted:
            return math.nan
        total += r.predicted[DENSE] - r.predicted.get(apply_rule(rule, r), r.predicted[DENSE])
    return total


class Plan:
    """The per-bucket decisions so far; ``str(plan)`` is the table logged once."""

    def __init__(self, rows: Sequence[PlanRow], model: CostModel | None, topology,
                 tuner: Autotuner | None = None):
        self.rows, self.model, self.topology, self.tuner = list(rows), model, topology, tuner

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, bucket: int) -> PlanRow:
        for r in self.rows:
            if r.bucket == bucket:
                return r
        raise KeyError(bucket)

    def __str__(self) -> str:
        names = []
        for r in self.rows:
            names += [k for k in r.predicted if k not in names]
        head = f"{'bucket':>6} {'numel':>11} {'bytes':>12} {'chosen':>16}  " + " ".join(f"{n:>15}" for n in names)
        lines = [head + "  (predicted ms)"]
        for r in self.rows:
            cells = " ".join(f"{r.predicted[n] * 1e3:>15.2f}" if n in r.predicted else f"{'-':>15}" for n in names)
            note = r.reason if r.reason != "cheapest" else ""
            if r.model_choice and r.model_choice != r.chosen:
                note = (note + "; " if note else "") + f"model: {r.model_choice}"
            lines.append(f"{r.bucket:>6} {r.numel:>11} {r.nbytes:>12} {r.chosen:>16}  {cells}"
                         + (f"  [{note}]" if note else ""))
        if self.tuner is not None:
            lines.append(str(self.tuner))
            errors = self.model_errors()
            if errors:
                lines.append("model vs measured, step time beyond dense (ms): " + ", ".join(
                    f"{rule} predicted {p * 1e3:+.1f} measured {m * 1e3:+.1f}" for rule, (p, m) in errors.items()))
        if self.topology is not None:
            lines.append(f"topology: nodes={self.topology.nodes}")
        if self.model is not None:
            lines.append(str(self.model))
        return "\n".join(lines)

    __repr__ = __str__

    def model_errors(self) -> dict:
        """``{rule: (predicted, measured)}`` seconds per step beyond dense, for every tried
        rule with a measured median: the model predicts communication per bucket, the tuner
        measures whole steps, and their differences to dense are comparable."""
        if self.tuner is None or not self.tuner.table:
            return {}
        measured = {r: s for r, s, _ in self.tuner.table}
        dense = measured.get(DENSE, math.nan)
        rows = [replace(r, chosen=r.model_choice or r.chosen) for r in self.rows]  # the model's own picks
        out = {}
        for rule, s in measured.items():
            if rule == DENSE or not (math.isfinite(s) and math.isfinite(dense)):
                continue
            saving = predicted_saving(rows, rule)
            if math.isfinite(saving):
                out[rule] = (-saving, s - dense)
        return out
