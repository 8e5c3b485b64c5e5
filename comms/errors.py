"""How commpress names a failed operation: one wording for every error a collective raises."""

from __future__ import annotations

__all__ = ["where"]


def _rank(comm) -> str:
    """``"rank R of W"`` in the default group; a sub-group's collective (hierarchical tiers, a
    mesh dimension) also says its rank there, so every rank's error names the same numbering."""
    text = f"rank {comm.rank} of {comm.world_size}"
    if getattr(comm, "group", None) is None:
        return text
    try:
        import torch.distributed as dist

        g, gw = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - no default group: the sub-group's numbering only
        return text
    if (g, gw) == (comm.rank, comm.world_size):
        return text
    return f"rank {g} of {gw} ({text} in its sub-group)"


def where(comm, what: str, bucket: int, numel: int, dtype, step: int, unit: str | None = None) -> str:
    """``"commpress: <what> of bucket B (N x dtype) at step S on rank R of W"``; ``unit``
    names what ``bucket`` indexes otherwise (FSDP: ``"module 'layers.0'"``)."""
    return (f"commpress: {what} of {unit or f'bucket {bucket}'} ({numel} x "
            f"{str(dtype).replace('torch.', '')}) at step {step} on {_rank(comm)}")
