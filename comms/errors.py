"""How commpress names a failed operation: one wording for every error a collective raises."""

from __future__ import annotations

__all__ = ["where"]


def where(comm, what: str, bucket: int, numel: int, dtype, step: int) -> str:
    """``"commpress: <what> of bucket B (N x dtype) at step S on rank R of W"``."""
    return (f"commpress: {what} of bucket {bucket} ({numel} x {str(dtype).replace('torch.', '')}) "
            f"at step {step} on rank {comm.rank} of {comm.world_size}")
