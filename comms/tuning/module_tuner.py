"""``ModuleTuner``: ``algorithm="auto"`` for FSDP and HSDP — per module, dense or compressed,
decided by measured calls.

The FSDP reduce-scatter and the HSDP all-reduce hook run synchronously, so the wall time of
one module's call is exactly what its communication costs the step. After the warm-up ramp
each module alternates dense and compressed calls (dense first); the first call of each is
not counted (allocation, a cold codec). After ``trials`` counted calls of each, every rank
adds its two medians into one tiny all-reduce (the same numbers, so the same decision on every
rank) and the module keeps the compressed route only when it is faster by more than
``prefer_dense`` (a tie goes to dense: it is exact and costs no memory).
"""

from __future__ import annotations

import logging

import torch

from ..algorithms import DENSE
from ..transport.notices import notice
from ..transport.waits import wait

__all__ = ["ModuleTuner", "COMPRESSED"]

logger = logging.getLogger(__name__)

COMPRESSED = "compressed"


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class ModuleTuner:
    """Per-module dense/compressed decisions from timed calls (see the module docstring).

    Args:
        trials: counted calls of each route before deciding (>= 1).
        prefer_dense: the compressed route must be faster by more than this fraction (a
            negative value: it is kept unless slower by more than ``-prefer_dense``).

    Example::

        >>> t = ModuleTuner(trials=2)
        >>> [t.route(0, k) for k in range(-1, 4)]
        ['compressed', 'dense', 'compressed', 'dense', 'compressed']
    """

    def __init__(self, trials: int = 4, prefer_dense: float = 0.03):
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
            raise ValueError(f"trials must be an int >= 1, got {trials!r}")
        self.trials, self.prefer_dense = trials, float(prefer_dense)
        self.times: dict[int, dict[str, list[float]]] = {}
        self.decision: dict[int, str] = {}
        self.medians: dict[int, tuple[float, float]] = {}

    @property
    def decide_at(self) -> int:
        """The tuning call index (from the end of the warm-up) at which a module decides."""
        return 2 * (self.trials + 1)

    def route(self, index: int, k: int) -> str:
        """The route of module ``index`` at tuning call ``k`` (negative: still warming up)."""
        if index in self.decision:
            return self.decision[index]
        if k < 0:
            return COMPRESSED
        return DENSE if k % 2 == 0 else COMPRESSED

    def due(self, index: int, k: int) -> bool:
        """Whether module ``index`` decides before its call ``k``."""
        return index not in self.decision and k >= self.decide_at

    def record(self, index: int, k: int, route: str, seconds: float) -> None:
        """One timed call; the first call of each route (``k`` < 2) is not counted."""
        if index in self.decision or k < 2:
            return
        self.times.setdefault(index, {DENSE: [], COMPRESSED: []})[route].append(seconds)

    def decide(self, index: int, comm, name: str) -> str:
        """Agree on module ``index``'s route (one 2-element all-reduce on ``comm``)."""
        t = self.times.get(index, {DENSE: [], COMPRESSED: []})
        mine = [_median(t[DENSE]) if t[DENSE] else 0.0, _median(t[COMPRESSED]) if t[COMPRESSED] else 0.0]
        total = wait(comm.all_reduce(torch.tensor(mine, dtype=torch.float64)), comm.timeout,
                     f"commpress: auto decision all-reduce of FSDP module {name!r} on rank {comm.rank}")
        dense_s, comp_s = (float(v) / comm.world_size for v in total.tolist())
        choice = COMPRESSED if comp_s < dense_s * (1.0 - self.prefer_dense) else DENSE
        self.decision[index], self.medians[index] = choice, (dense_s, comp_s)
        self.times.pop(index, None)
        notice(logger, "commpress: auto locked %s for FSDP module %r: compressed call %.2f ms vs "
               "dense %.2f ms (median of %d each, mean over ranks); tuning took %d calls", choice,
               name, comp_s * 1e3, dense_s * 1e3, self.trials, self.decide_at, rank=comm.rank)
        return choice

    def state_dict(self) -> dict:
        return {"decision": {int(i): d for i, d in self.decision.items()},
                "medians": {int(i): list(m) for i, m in self.medians.items()}}

    def load_state_dict(self, sd: dict) -> None:
        bad = [d for d in sd.get("decision", {}).values() if d not in (DENSE, COMPRESSED)]
        if bad:
            raise ValueError(f"tuner state holds unknown routes {bad}")
        self.decision = {int(i): d for i, d in sd.get("decision", {}).items()}
        self.medians = {int(i): tuple(m) for i, m in sd.get("medians", {}).items()}
        self.times = {}

    def __str__(self) -> str:
        if not self.decision:
            return "auto: tuning"
        parts = [f"{i}:{d}" for i, d in sorted(self.decision.items())]
        return f"auto: {' '.join(parts)} (after {self.decide_at} tuning calls per module)"
