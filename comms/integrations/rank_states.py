"""``RankStates``: one checkpoint entry holding every rank's commpress state.

Frameworks write one checkpoint from one process, but commpress residuals are per rank.
:meth:`RankStates.state_dict` is collective (every rank calls it when the framework saves):
it all-gathers each rank's ``state.state_dict()`` so the writer holds all of them;
:meth:`RankStates.load_state_dict` picks this rank's entry (no communication) and refuses a
checkpoint from another world size. Size: ``world`` x one rank's state (the residuals).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

__all__ = ["RankStates"]

logger = logging.getLogger(__name__)


class RankStates:
    """Wraps a :class:`comms.CompressionState` or :class:`comms.fsdp.FSDPCompressionState`.

    Args:
        state: the commpress state of this rank.
        group: the group whose ranks index the entries (``None``: WORLD).

    Example::

        >>> accelerator.register_for_checkpointing(RankStates(state))
    """

    def __init__(self, state, group=None):
        self.state, self.group = state, group

    def _rank_world(self) -> tuple[int, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def state_dict(self) -> dict[str, Any]:
        """Collective: every rank's state, in rank order (``{"world": W, "ranks": [...]}``)."""
        rank, world = self._rank_world()
        mine = self.state.state_dict()
        if world == 1:
            return {"world": 1, "ranks": [mine]}
        out = [None] * world
        dist.all_gather_object(out, mine, group=self.group)
        return {"world": world, "ranks": out}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load this rank's entry.

        Raises:
            ValueError: the checkpoint was written by another world size.
        """
        rank, world = self._rank_world()
        if not isinstance(sd, dict) or "ranks" not in sd:
            raise TypeError(f"expected a dict from RankStates.state_dict(), got {type(sd).__name__}")
        if sd["world"] != world:
            raise ValueError(f"commpress state was saved by {sd['world']} ranks, this run has {world}; "
                             "residuals are per rank and cannot be re-split")
        self.state.load_state_dict(sd["ranks"][rank])
