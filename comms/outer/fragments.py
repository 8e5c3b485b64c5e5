"""Fragments of a model for the outer sync, and the steps each is sent and applied.

Streaming DiLoCo syncs the parameters in fragments, in turn: with ``H`` inner steps between a
fragment's syncs and ``P`` fragments, fragment ``p`` is sent after the optimizer steps
``t`` with ``t % H == p * H // P`` (its first after ``p * H // P`` steps, ``H`` for fragment 0),
and its average is applied ``tau`` steps later, so the transfer overlaps ``tau`` inner steps.
Fragments are runs of consecutive parameters of about equal size (a parameter is never split).
"""

from __future__ import annotations

__all__ = ["split_fragments", "Schedule"]


def split_fragments(numels: list[int], count: int) -> list[list[int]]:
    """Consecutive parameter indices in ``count`` runs of about equal total size (fewer when
    there are fewer parameters); every parameter in exactly one run."""
    if not numels:
        return []
    count = max(1, min(count, len(numels)))
    total, out, run, acc = sum(numels), [], [], 0
    for i, n in enumerate(numels):
        run.append(i)
        acc += n
        left = len(numels) - i - 1
        # close the run at its share of the total, keeping one parameter for each run to come
        if len(out) < count - 1 and (acc * count >= total * (len(out) + 1) or left == count - 1 - len(out)):
            out.append(run)
            run = []
    if run:
        out.append(run)
    return out


class Schedule:
    """When each fragment is sent and applied (see the module docstring).

    Args:
        every: ``H``, inner steps between two syncs of a fragment (>= 1).
        fragments: ``P``, the number of fragments (>= 1).
        delay: ``tau``, inner steps between a fragment's send and its application (0 <= tau < H).
    """

    def __init__(self, every: int, fragments: int, delay: int):
        self.every, self.fragments, self.delay = every, fragments, delay

    def offset(self, p: int) -> int:
        return p * self.every // self.fragments

    def sends(self, t: int) -> list[int]:
        """The fragments sent after optimizer step ``t`` (1-based)."""
        return [p for p in range(self.fragments) if t >= 1 and t % self.every == self.offset(p) % self.every]
