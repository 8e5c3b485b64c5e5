"""The autotuner's watchdog: after the lock, re-time the runner-up now and then and tune again
when it wins or when the locked plan drifted.

Every ``watch_every`` steps (default 200) the runner-up (dense when a compressed plan is
locked, else the best compressed rule) runs for ``steps_per_trial`` steps; the agreed
comparison with the locked plan's recent steps triggers a new tuning when the runner-up now
wins, or when the locked plan's recent median got slower than its tuned score by more than
``drift`` (25%) and 5 ms (load, link changes).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

from ..algorithms import DENSE
from .autotune_rules import MIN_GAIN_S

__all__ = ["Watchdog"]

logger = logging.getLogger("comms.tuning.autotune")


class Watchdog:
    """The watchdog half of :class:`comms.tuning.autotune.Autotuner` (a mixin: it reads the lock,
    ``decision`` and ``table``, the per-step ``_durations``, and starts a new phase through
    ``_restart``)."""

    decision: str | None
    table: list
    steps: int
    watch_every: int
    drift: float
    prefer_dense: float
    rule: str | None
    _durations: dict
    _recent: deque
    _check: list
    _locked_at: int | None

    def _runner_up(self) -> str | None:
        if self.decision != DENSE:
            return DENSE
        rest = [(s, r) for r, s, _ in self.table if r != DENSE and math.isfinite(s)]
        return min(rest)[1] if rest else None

    def _watch(self, step: int, agree) -> str:
        """This step's rule after the lock: the locked one, or the runner-up during a check;
        at the end of a check the agreed verdict (a collective, on every rank alike)."""
        if self._locked_at is None:
            self._locked_at = step
        if self._check:
            if step <= self._check[-1][0]:
                self.rule = dict(self._check)[step]
                return self.rule
            if self._end_check(step, agree):
                return self._restart(step)
        else:
            d = self._durations.pop(step - 1, None)
            if d is not None and self.rule == self.decision:
                self._recent.append(d)
            self._durations.clear()
        other = self._runner_up()
        if self.watch_every and other is not None and step - self._locked_at >= self.watch_every:
            self._check = [(step + j, other) for j in range(self.steps)]
            self.rule = other
            return other
        self.rule = self.decision
        return self.rule

    def _end_check(self, step: int, agree) -> bool:
        """The check is over (its last step's time is known now): agree on the runner-up's
        steps and the locked plan's recent median; True: tune again."""
        got = [self._durations.get(s, math.nan) for s, _ in self._check[1:]]
        recent = statistics.median(self._recent) if self._recent else math.nan
        vals = list(agree(got + [recent]))
        finite = [v for v in vals[:-1] if math.isfinite(v)]
        challenger = statistics.median(finite) if finite else math.nan
        recent = vals[-1]
        self._check = []
        self._recent.clear()
        self._durations.clear()
        self._locked_at = step
        if not self._should_retune(challenger, recent):
            return False
        logger.info("autotune watchdog at step %d: locked %r %.1f ms (tuned %.1f ms), "
                    "runner-up %.1f ms: tuning again", step, self.decision,
                    recent * 1e3, self._score() * 1e3, challenger * 1e3)
        return True

    def _restart(self, step: int) -> str:  # pragma: no cover - provided by the tuner
        raise NotImplementedError

    def _score(self) -> float:
        return dict((r, s) for r, s, _ in self.table).get(self.decision, math.nan)

    def _should_retune(self, challenger: float, recent: float) -> bool:
        score = self._score()
        # drift: the locked plan got slower by more than `drift` of its score and by more than
        # a few ms (millisecond steps on a shared CPU move by 25% from scheduling alone)
        if math.isfinite(recent) and math.isfinite(score) and score > 0 \
                and recent - score > max(self.drift * score, 5 * MIN_GAIN_S):
            return True
        if not (math.isfinite(challenger) and math.isfinite(recent)):
            return False
        return challenger < min(recent * (1 - self.prefer_dense), recent - MIN_GAIN_S)
