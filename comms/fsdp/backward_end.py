"""``BackwardEnd``: what runs when the current backward ends (autograd's final callback).

The overlapped FSDP reduce-scatter lands there (its exchange ran during the rest of backward),
and the gradients of parameters that got none are dropped there again (:mod:`comms.fsdp.unused`),
after FSDP's own final callback (queued when backward started) has assigned every sharded
gradient.
"""

from __future__ import annotations

import torch

__all__ = ["BackwardEnd"]


class BackwardEnd:
    """The work queued for the end of the current backward, run in queue order."""

    def __init__(self):
        self._pending: list = []
        self.deferred_calls = 0  # reduce-scatters that overlapped backward (report)

    def add(self, fn) -> None:
        """Run ``fn`` when the current backward ends, after what was queued before it."""
        if not self._pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self._pending.append(fn)

    def defer(self, finish) -> None:
        """A reduce-scatter whose exchange overlaps the rest of backward: ``finish`` lands it."""
        self.add(finish)
        self.deferred_calls += 1

    def finish(self) -> None:
        """Run what is queued, in order (bounded waits). Runs by itself when backward ends;
        call it before reading gradients inside backward."""
        # taken out first: if one raises, the next backward starts with an empty list (and
        # queues its own callback) instead of finishing a broken step's calls
        pending, self._pending = self._pending, []
        for fn in pending:
            fn()
