"""How the ``auto`` planner ranks whole-step rules for the autotuner.

A rule applies to every bucket of a step (``"dense"``, ``"model"``: the cost model's
per-bucket pick, or an algorithm name; :func:`comms.tuning.plan_table.apply_rule`). Two
rankings come from the planner's per-bucket rows and the agreed cost model, so every rank
computes the same ones: which compressed rules get a trial, best predicted step first
(:func:`propose_rules`), and which of several winners the tuner locks when their measured step
times tie (:func:`tie_preference`, built from :func:`tie_cost`).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from ..algorithms import ALGORITHMS, DENSE, get_algorithm
from .autotune import MODEL
from .autotune_rules import MIN_GAIN_S
from .cost_model import CostModel, TierCost
from .plan_table import PlanRow, apply_rule

__all__ = ["propose_rules", "tie_cost", "tie_preference"]


def propose_rules(rows: Sequence[PlanRow], candidates: Sequence[str]) -> list[str]:
    """Compressed rules for the buckets of ``rows``, best predicted step first, each running
    a different plan on them (ties keep the model's rule, then the candidates' order); rules
    that run all-dense or have no finite prediction are left out."""
    options = []
    for order, rule in enumerate([MODEL, *candidates]):
        assign = tuple(apply_rule(rule, r) for r in rows)
        total = sum(r.predicted.get(a, math.inf) for r, a in zip(rows, assign))
        options.append((total, order, rule, assign))
    seen = {tuple(DENSE for _ in rows)}
    out = []
    for total, _, rule, assign in sorted(options):
        if assign in seen or not math.isfinite(total):
            continue
        seen.add(assign)
        out.append(rule)
    return out


def tie_preference(model: CostModel | None, compressor, rows: Iterable[PlanRow], rule: str) -> tuple:
    """Sort key of a rule among tied winners, per bucket (largest first): first how many
    times it compresses the bucket (``Algorithm.compress_stages``: a two_phase plan's owners
    compress the sum again — top-k's owners keep k of up to ``world * k`` values, which cost
    the momentum task 1.093x dense's loss at 4 ranks against allgather's 1.032; a tie in step
    time must not buy that), then the bytes its collectives put on the slowest tier's links,
    then its local codec work (:meth:`CostModel.codec_seconds`, in whole milliseconds:
    :data:`MIN_GAIN_S`), then its collectives' ring hops (the latency terms), then the
    registry order (allreduce, allgather, two_phase, shared_scale, hierarchical). Fewer bytes
    is the plan that keeps winning when the link changes; with the bytes equal, the work
    around the wire decides — at 2 ranks qsgd8's shared_scale decodes one integer sum where
    allgather decodes and adds two payloads, and it ran 4-9% faster in every measured run
    (unshaped, 10 Gb/s and 1 Gb/s links) where hops alone picked allgather — and a
    sparsifier's adds are too small to count (random-k: allgather, in half the hops of an
    allreduce). Only the agreed cost model, world sizes, shapes and the compressor enter:
    the same key on every rank."""
    order = {name: i for i, name in enumerate(ALGORITHMS)}
    rows = sorted(rows, key=lambda r: (-r.numel, r.bucket))
    return tuple((0 if a == DENSE else get_algorithm(a).compress_stages,)
                 + tie_cost(model, compressor, a, r) + (order.get(a, -1),)
                 for r in rows for a in (apply_rule(rule, r),))


def tie_cost(model: CostModel | None, compressor, algorithm: str, row: PlanRow) -> tuple:
    """``(link bytes on the slowest tier, codec work in whole ms, ring hops)`` of one
    bucket's plan; ``()`` without a cost model."""
    if model is None:
        return ()
    ops = model.wire_ops(algorithm, None if algorithm == DENSE else compressor, row.numel, row.dtype)
    slow = "inter" if any(t == "inter" for t, *_ in ops) else "flat"
    nbytes = hops = 0.0
    for tier, op, _, b in ops:
        n = model.tiers[tier].world if tier in model.tiers else 1
        if tier == slow:
            nbytes += TierCost.factor(op, n) * b
        hops += TierCost.hops(op, n)
    codec = model.codec_seconds(algorithm, compressor, row.numel, row.dtype)  # dense: 0
    return (nbytes, round(codec / MIN_GAIN_S) if math.isfinite(codec) else math.inf, hops)
