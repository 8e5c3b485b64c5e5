"""Bytes each rank sends per DDP step under a hook configuration (the ``wire_MB`` columns),
and which algorithm its buckets actually used (the ``algorithm`` column)."""

from __future__ import annotations

from typing import Iterable

from .hooks import HookConfig

__all__ = ["dense_wire_bytes", "torch_powersgd_wire_bytes", "config_wire_bytes", "config_algorithm"]


def dense_wire_bytes(numel: int, world: int, itemsize: int = 4) -> int:
    """Bytes each rank sends in a ring allreduce of ``numel`` elements."""
    return 2 * (world - 1) * numel * itemsize // world


def torch_powersgd_wire_bytes(params: Iterable, rank: int, world: int,
                              min_compression_rate: float = 2.0) -> int:
    """Bytes per rank per step of torch's ``powerSGD_hook`` (its own compress-or-not rule):
    matrices with ``(rows + cols) * rank * rate < rows * cols`` send P and Q, the rest go dense."""
    elems = 0
    for p in params:
        if p.dim() > 1:
            rows = p.shape[0]
            cols = p.numel() // rows
            if (rows + cols) * rank * min_compression_rate < rows * cols:
                elems += (rows + cols) * rank
                continue
        elems += p.numel()
    return dense_wire_bytes(elems, world)


def config_wire_bytes(cfg: HookConfig, state, params: list, world: int) -> int | None:
    """Bytes each rank sends per step with ``cfg`` (after warm-up)."""
    numel = sum(p.numel() for p in params)
    if cfg.kind == "dense":
        return dense_wire_bytes(numel, world)
    if cfg.kind == "torch-fp16":
        return dense_wire_bytes(numel, world, 2)
    if cfg.kind == "torch-powersgd":
        return torch_powersgd_wire_bytes(params, cfg.rank, world)
    outer = getattr(state, "outer", None)
    if outer is not None:  # one round of fragments every H steps, spread over its steps
        return outer.state.wire_bytes_per_step() // outer.schedule.every
    # buckets in state.stats were compressed; the rest (e.g. the auto planner chose dense) were not
    stats = getattr(state, "stats", {}) or {}
    covered = sum(s.dense_bytes for s in stats.values())
    return sum(s.wire_bytes for s in stats.values()) + max(0, dense_wire_bytes(numel, world) - covered)


def config_algorithm(cfg: HookConfig, state, dense_bytes: int) -> str:
    """The algorithm column: for ``auto``, what the planner chose for the buckets."""
    if cfg.kind != "ours":
        return cfg.kind
    outer = getattr(state, "outer", None)
    if outer is not None:
        return f"outer:{outer.state.router.name}"
    if cfg.algorithm != "auto" and not cfg.default:
        return cfg.algorithm or "-"
    stats = getattr(state, "stats", {}) or {}
    chosen = sorted({s.algorithm for s in stats.values()})
    if sum(s.dense_bytes for s in stats.values()) < dense_bytes:
        chosen.append("dense")
    return "auto:" + "+".join(dict.fromkeys(chosen))
