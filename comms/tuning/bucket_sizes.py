"""Bucket planning: DDP bucket sizes that amortise per-collective latency on the slow tier.

A bucket of ``B`` bytes costs ``alpha + f * B / beta`` on a tier (``f`` the allreduce link
factor ``2(n-1)/n``). The latency is at most ``1 - efficiency`` of that when
``B >= efficiency / (1 - efficiency) * alpha * beta / f``. Larger buckets also mean fewer
hook calls; smaller ones overlap better with the backward pass, so the suggestion is the
smallest size that reaches the efficiency, at least ``min_mb`` and at most the model.

Example::

    >>> cap = comms.suggest_bucket_cap_mb(model, planner.model)
    >>> ddp = DistributedDataParallel(model, bucket_cap_mb=cap)
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch.nn.parallel import DistributedDataParallel

from .cost_model import CostModel, TierCost
from ..cluster.topology import Topology

__all__ = ["suggest_bucket_cap_mb", "suggest_bucket_cap_mb_list", "ddp_has_bucket_cap_mb_list",
           "ASSUMED_TIERS"]

logger = logging.getLogger(__name__)

_MB = 1024 * 1024
# used when only a Topology (no measurement) is given: a typical node and 10 Gb/s Ethernet
ASSUMED_TIERS = {"intra": TierCost("intra", 2, 50e-6, 10e9), "inter": TierCost("inter", 2, 200e-6, 1.25e9)}


def ddp_has_bucket_cap_mb_list() -> bool:
    """Whether the installed torch's DDP takes ``bucket_cap_mb_list`` (torch >= 2.12)."""
    return "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


def _slow_tier(cost) -> TierCost:
    model = getattr(cost, "model", cost)  # a Planner carries its CostModel
    if isinstance(model, CostModel):
        return model.tiers.get("inter") or model.tiers["flat"]
    if isinstance(cost, Topology):
        t = ASSUMED_TIERS["inter"] if cost.num_nodes > 1 else ASSUMED_TIERS["intra"]
        world = cost.num_nodes if cost.num_nodes > 1 else cost.local_size
        return TierCost(t.name, max(2, world), t.alpha, t.beta)
    if isinstance(cost, TierCost):
        return cost
    raise TypeError(f"need a CostModel, Planner, Topology or TierCost, got {type(cost).__name__}")


def _grad_bytes(model: torch.nn.Module) -> int:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def suggest_bucket_cap_mb(model: torch.nn.Module, cost, *, efficiency: float = 0.9,
                          min_mb: float = 1.0) -> float:
    """``bucket_cap_mb`` for DDP so each bucket spends >= ``efficiency`` of its time moving bytes.

    Args:
        model: the module DDP wraps (its trainable parameters' bytes cap the result).
        cost: a :class:`~comms.tuning.cost_model.CostModel` (or a planner holding one), a
            :class:`~comms.cluster.topology.Topology` (assumed link figures, see ``ASSUMED_TIERS``),
            or a :class:`~comms.tuning.cost_model.TierCost` for the slow tier.
        efficiency: target fraction of bucket time spent on bandwidth, in (0, 1).
        min_mb: lower bound in MiB.

    Raises:
        ValueError: ``efficiency`` outside (0, 1) or ``min_mb`` <= 0.
    """
    if not isinstance(efficiency, (int, float)) or not 0 < efficiency < 1:
        raise ValueError(f"efficiency must be in (0, 1), got {efficiency!r}")
    if not isinstance(min_mb, (int, float)) or min_mb <= 0:
        raise ValueError(f"min_mb must be > 0, got {min_mb!r}")
    tier = _slow_tier(cost)
    n = max(2, tier.world)
    factor = 2 * (n - 1) / n
    need = efficiency / (1 - efficiency) * tier.alpha * tier.beta / factor
    total = _grad_bytes(model)
    cap = max(min_mb * _MB, min(need, total))
    logger.info("bucket cap: %.2f MiB (slow tier %s: alpha %.2f ms, beta %.3f GB/s; model %.1f MiB)",
                cap / _MB, tier.name, tier.alpha * 1e3, tier.beta / 1e9, total / _MB)
    return round(cap / _MB, 3)


def suggest_bucket_cap_mb_list(model: torch.nn.Module, cost, **kw) -> list[float] | None:
    """Per-bucket caps for DDP's ``bucket_cap_mb_list`` (``None`` where torch lacks it).

    Every bucket gets the amortising cap; the last one takes the remainder, so DDP builds
    ``ceil(model / cap)`` buckets.
    """
    if not ddp_has_bucket_cap_mb_list():
        return None
    cap = suggest_bucket_cap_mb(model, cost, **kw)
    total_mb = _grad_bytes(model) / _MB
    k = max(1, int(-(-total_mb // cap)))
    return [cap] * k
