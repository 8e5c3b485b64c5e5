"""``state.plan``: the per-bucket decisions of the ``auto`` planner as a table.

One row per bucket (its size, what it runs now, every candidate's predicted time, why), then
the autotuner's trial table, the model's predicted step time beyond dense next to the
measured one for each tried rule, the topology and the cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..algorithms import DENSE
from .autotune import MODEL, Autotuner
from .cost_model import CostModel

__all__ = ["Plan", "PlanRow"]


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
        out = {}
        for rule, s in measured.items():
            if rule == DENSE or not (math.isfinite(s) and math.isfinite(dense)):
                continue
            pred = 0.0
            for r in self.rows:
                name = r.model_choice if rule == MODEL else rule
                t = r.predicted.get(name if r.reason == "cheapest" else DENSE, r.predicted.get(DENSE))
                if t is None or DENSE not in r.predicted:
                    break
                pred += t - r.predicted[DENSE]
            else:
                out[rule] = (pred, s - dense)
        return out
