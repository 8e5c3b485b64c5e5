"""``Autotuner``: the measured half of ``algorithm="auto"``.

The cost model only *proposes*. During the first compressed iterations the tuner runs a few
whole-step plans ("rules") for ``steps_per_trial`` steps each — always all-dense, then the
cost model's top proposals — times every step, agrees on the timings across ranks and locks
in the fastest. Dense wins unless a compressed plan is at least ``prefer_dense`` (3%) faster:
a compressor that shrinks bytes but slows the step is a bug.

A rule applies to every bucket of a step:

* ``"dense"``: plain allreduce everywhere;
* ``"model"``: the cost model's per-bucket choice;
* an algorithm name (``"allreduce"``, ``"hier_allgather"``, ...): that algorithm for every
  bucket the planner would compress at all (small and 1-D buckets stay dense).

Timing. A step's time is the wall time between the hook's calls for bucket 0 of consecutive
steps (DDP always launches bucket 0 first, and only after the previous step's futures were
waited for), so it spans one whole training step — forward, backward, communication,
optimizer — and sees everything a plan costs: codec time, lost overlap, page faults. The
first step of each trial is not counted (switching plans allocates buffers and flushes
residuals). Each rank's per-step times are MAX-reduced (one small allgather at the end of
the trial phase, when no collective is in flight), the score of a trial is the median of its
steps, and every rank runs the same deterministic decision on the same numbers — so every
rank adopts the SAME plan (a plan that differed between ranks would mismatch collectives).

Error feedback across switches: when a bucket moves to another algorithm, the hook adds the
residuals that belonged to the old one (its own EF residual when the bucket goes dense, the
two-phase owner residual always) into the bucket once and clears them
(``Algorithm.flush_residual_``), so no gradient mass is lost.

Example::

    >>> state = comms.register(ddp_model, "powersgd:rank=1")   # auto + autotune by default
    >>> ... train 20 steps ...
    >>> print(state.plan)        # per-bucket table, then the trial table and the locked rule
    >>> state.retune()           # on every rank at the same step: tune again (links changed)

.. warning::
    Tuning starts at the first step ``>= start_iter`` and lasts about
    ``(trials + 1) * steps_per_trial`` steps, during which some steps run slower plans.
    ``retune()`` must be called on every rank before the same step.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Callable, Sequence

from .algorithms import DENSE

__all__ = ["Autotuner", "choose_rule", "DENSE", "MODEL", "MIN_GAIN_S"]

logger = logging.getLogger(__name__)

MODEL = "model"


class Autotuner:
    """Trial schedule, per-step timing and the agreed decision.

    Args:
        steps_per_trial: steps each plan runs (>= 2; the first is not counted).
        trials: compressed plans to try besides all-dense (the cost model's best few).
        prefer_dense: a compressed plan must be at least this fraction faster than dense.
        candidates: explicit rules to try instead of the cost model's proposals (``"dense"``
            is always tried first).

    Attributes:
        timing: ``None``, or ``fn(rule, seconds) -> seconds`` applied to each locally measured
            step time before the agreement (tests inject timings with it).
        locked: the decision is made; ``rule`` holds it.
        table: ``[(rule, seconds or nan, steps counted)]`` of the last trial phase.
    """

    def __init__(self, steps_per_trial: int = 3, trials: int = 3, prefer_dense: float = 0.03,
                 candidates: Sequence[str] | None = None):
        if isinstance(steps_per_trial, bool) or not isinstance(steps_per_trial, int):
            raise TypeError(f"autotune_steps must be an int, got {steps_per_trial!r}")
        if steps_per_trial < 2:
            raise ValueError(f"autotune_steps must be >= 2 (the first step of a trial is not "
                             f"counted), got {steps_per_trial!r}")
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
            raise ValueError(f"trials must be an int >= 0, got {trials!r}")
        if not isinstance(prefer_dense, (int, float)) or not 0 <= prefer_dense < 1:
            raise ValueError(f"prefer_dense must be in [0, 1), got {prefer_dense!r}")
        if candidates is not None and (isinstance(candidates, str)
                                       or not all(isinstance(c, str) for c in candidates)):
            raise TypeError(f"candidates must be a list of rule names, got {candidates!r}")
        self.steps = steps_per_trial
        self.n_trials = trials
        self.prefer_dense = float(prefer_dense)
        self.candidates = None if candidates is None else list(candidates)
        self.timing: Callable[[str, float], float] | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the decision and the measurements; the next step starts a trial phase."""
        self.locked = False
        self.rule: str | None = None
        self.start: int | None = None
        self.trials: list[str] = []
        self.table: list[tuple[str, float, int]] = []
        self._durations: dict[int, float] = {}
        self._last: tuple[int, float] | None = None  # (step, clock) of the last bucket-0 call

    # -- per step -------------------------------------------------------------------------
    def rule_of(self, step: int) -> str | None:
        if self.locked or self.start is None:
            return self.rule
        k = (step - self.start) // self.steps
        return self.trials[k] if 0 <= k < len(self.trials) else None

    def begin_step(self, step: int, now: float, propose: Callable[[], list[str]],
                   agree: Callable[[list[float]], list[float]]) -> str:
        """Called at bucket 0 of every tuned step, on every rank; returns this step's rule.

        ``propose()`` gives the compressed rules ranked best first (identical on all ranks);
        ``agree(values)`` returns the element-wise MAX over ranks (a collective; only called
        once, when the trial phase ends).
        """
        last, self._last = self._last, (step, now)
        if self.locked:
            return self.rule
        if last is not None and last[0] == step - 1 and self.start is not None:
            seconds = now - last[1]
            rule = self.rule_of(step - 1)
            if self.timing is not None and rule is not None:
                seconds = float(self.timing(rule, seconds))
            self._durations[step - 1] = seconds
        if self.start is None:
            proposed = self.candidates if self.candidates is not None else propose()[: self.n_trials]
            self.trials = [DENSE] + [r for r in dict.fromkeys(proposed) if r != DENSE]
            self.start = step
            logger.debug("autotune: trials %s from step %d, %d steps each", self.trials, step, self.steps)
        rule = self.rule_of(step)
        if rule is not None:
            self.rule = rule
            return rule
        self._decide(agree)
        return self.rule

    def _decide(self, agree) -> None:
        counted = self.steps - 1
        vec = [self._durations.get(self.start + i * self.steps + j, math.nan)
               for i in range(len(self.trials)) for j in range(1, self.steps)]
        vals = list(agree(vec)) if vec else []
        scores = []
        for i, rule in enumerate(self.trials):
            mine = [v for v in vals[i * counted:(i + 1) * counted] if math.isfinite(v)]
            scores.append((rule, statistics.median(mine) if mine else math.nan, len(mine)))
        self.table = scores
        self.rule = choose_rule(scores, self.prefer_dense)
        self.locked = True
        self._durations.clear()

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"locked": self.locked, "rule": self.rule if self.locked else None,
                "table": [[r, float(s), int(n)] for r, s, n in self.table]}

    def load_state_dict(self, sd: dict) -> None:
        """A locked decision is kept (no re-tuning); an unfinished trial phase starts afresh."""
        if not isinstance(sd, dict) or not isinstance(sd.get("locked"), bool):
            raise TypeError(f"autotune state must be a dict from Autotuner.state_dict(), got {sd!r}")
        if sd["locked"] and not isinstance(sd.get("rule"), str):
            raise TypeError(f"a locked autotune state needs a rule name, got {sd.get('rule')!r}")
        self.reset()
        if sd["locked"]:
            self.locked, self.rule = True, sd["rule"]
            self.table = [(str(r), float(s), int(n)) for r, s, n in sd.get("table", [])]

    def __str__(self) -> str:
        if not self.table:
            state = (f"trial phase from step {self.start}: {self.trials}" if self.start is not None
                     else "not started")
            return f"autotune: {state}" + (f", locked {self.rule!r}" if self.locked else "")
        dense = self.table[0][1]
        lines = [f"{'trial':>16} {'step ms':>10} {'steps':>6} {'vs dense':>9}"]
        for rule, s, n in self.table:
            rel = f"{dense / s:>8.2f}x" if math.isfinite(s) and math.isfinite(dense) and s > 0 else f"{'-':>9}"
            lines.append(f"{rule:>16} {s * 1e3:>10.1f} {n:>6} {rel}"
                         + ("   <- locked" if rule == self.rule else ""))
        lines.append(f"autotune: locked {self.rule!r} (a compressed plan must be >= "
                     f"{self.prefer_dense:.0%} faster than dense)")
        return "\n".join(lines)


# a compressed plan must also save at least this much per step: below it, 3 timed steps on a
# shared CPU cannot tell a real gain from scheduling noise (make demo's 2-5 ms steps picked a
# slower compressed plan once on relative margins alone)
MIN_GAIN_S = 1e-3


def choose_rule(scores: Sequence[tuple[str, float, int]], prefer_dense: float,
                min_gain: float = MIN_GAIN_S) -> str:
    """The fastest compressed rule if it beats dense by ``prefer_dense`` (relative) and by
    ``min_gain`` seconds, else ``"dense"``.

    ``scores[0]`` is dense. Ties keep the earlier (better-predicted) rule; a rule without a
    finite score never wins; without a dense score a compressed rule must simply be finite.
    """
    dense = scores[0][1] if scores and scores[0][0] == DENSE else math.nan
    best, best_t = DENSE, math.inf
    for rule, t, _ in scores:
        if rule != DENSE and math.isfinite(t) and t < best_t:
            best, best_t = rule, t
    if best == DENSE:
        return DENSE
    if math.isfinite(dense) and not best_t < min(dense * (1 - prefer_dense), dense - min_gain):
        return DENSE
    return best
