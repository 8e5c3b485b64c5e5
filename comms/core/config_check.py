"""The cross-rank configuration check: every rank must run the same configuration per bucket.

The first call for each ``(bucket, numel, dtype)`` allgathers one int64 hash per field of
:data:`comms.ddp.state.CONFIG_FIELDS` (compressor spec, algorithm, seed, start_iter, ..., step,
bucket numel and dtype) and raises ``ValueError`` on every rank, naming the field and this
rank's value, before the bucket's data moves. One host sync per bucket layout, then never
again for that layout.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from ..transport.waits import wait
from ..transport.errors import where

__all__ = ["ConfigCheck"]

logger = logging.getLogger(__name__)


class ConfigCheck:
    """Remembers which bucket layouts passed; checks each new one once (collective).

    Args:
        fields: the names of the compared fields, in order.
    """

    __slots__ = ("fields", "passed")

    def __init__(self, fields: Sequence[str]):
        self.fields = tuple(fields)
        self.passed: set = set()

    def check(self, comm, index: int, buf: torch.Tensor, step: int, hashes: Callable[[], list],
              values: Callable[[], tuple]) -> None:
        """Allgather ``hashes()`` (one int64 per field) unless this layout passed before;
        raise ``ValueError`` on every rank naming the first differing field and this rank's
        ``values()`` entry for it. ``RuntimeError`` when the allgather itself fails."""
        key = (index, buf.numel(), buf.dtype)
        if key in self.passed:
            return
        mine = hashes()
        t = torch.tensor(mine, dtype=torch.int64)
        if buf.device.type != "cpu" and comm.backend not in ("gloo", "mpi"):
            t = t.to(buf.device)
        what = where(comm, "configuration-check allgather", index, buf.numel(), buf.dtype, step)
        # one host sync per bucket layout (what follows depends on the answer), bounded by
        # the timeout: a stuck peer raises CollectiveTimeout here instead of blocking backward
        table = wait(comm.all_gather(t), getattr(comm, "timeout", None), what)
        table = table.view(comm.world_size, len(mine)).cpu().tolist()
        vals = values()
        for f, field in enumerate(self.fields):
            differ = [r for r, row in enumerate(table) if row[f] != table[0][f]]
            if differ:
                odd = [r for r, row in enumerate(table) if row[f] != mine[f]]
                raise ValueError(
                    f"commpress: compressor configuration differs between ranks at bucket {index}: "
                    f"{field} is {vals[f]!r} on rank {comm.rank}, different on rank(s) {odd}; every "
                    "rank must use the same compressor spec, algorithm, seed, start_iter, options, "
                    "step counter and bucket layout")
        self.passed.add(key)
