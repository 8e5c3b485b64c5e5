"""``Autotuner``: the measured half of ``algorithm="auto"``.

The cost model only *proposes*. From the first compressed iteration the tuner runs whole-step
plans ("rules") — always all-dense, then the cost model's best few proposals — **interleaved
in rounds** (dense, A, B, dense, A, B, ...; each rule for ``steps_per_trial`` steps), times
every step, agrees on the timings across ranks after each round (one small allgather, MAX per
step) and decides when **the data decides** (:mod:`comms.tuning.autotune_rules`):

* with ``screen`` set, a rule the cost model cannot see winning is never tried;
* in the first round the first step of each rule is not counted (a rule's first steps
  allocate its buffers: up to ~2x); from the second round every step counts (at 10 Gb/s a
  block's first step was within -0.9% .. +3.7% of its other steps);
* a rule whose every sample is slower than every dense sample is dropped — from round 2, two
  samples each at least: one slow step must not end a plan's trial (at 10 Gb/s one slow
  round-1 sample did, for a top-k plan 10% faster than dense, in 4 of 5 tunings);
* a compressed rule *wins* when its median beats dense's by ``prefer_dense`` (3%; DDP's
  ``register`` raises it to what the compressor's extra steps to dense's loss take back,
  :mod:`comms.tuning.quality_cost`) and by
  :data:`~comms.tuning.autotune_rules.MIN_GAIN_S`, and one of three tests says the gain is real:
  every sample faster than every dense one, a rank test over all sample pairs, or the step
  ratio paired by round (a round's steps are seconds apart, so the load both saw cancels);
* a rule that **surely cannot win** (paired by round, surely not ``prefer_dense`` faster) is
  dropped;
* tuning stops when no undecided rule is left after at least ``min_rounds`` (4) rounds, or
  when the next round would exceed ``max_steps`` (default 40 steps): then the fastest
  *winning* rule is locked, and dense when none won — an unclear result never compresses;
* **a decisive result stops earlier**: from round 2 on, when the fastest winner's every
  sample beats every dense sample by ``decisive`` (10%) and every other rule is dropped or
  has every sample slower than every sample of that winner by ``decisive``, it is locked
  before ``min_rounds`` (at 1 Gb/s: half the tuning steps);
* **dense retires once beaten decisively**: from round 2 on, when every rule still in play
  beats dense that way (and by ``prefer_dense`` where larger), dense runs no more trial steps
  (its samples still judge every rule) and those rules keep their win over dense for good.

Interleaving matters on a shared machine: a load burst hits every rule of a round, not one
rule's block. Every rank decides alike on the same agreed numbers: the SAME plan everywhere.
After the lock the watchdog (:mod:`comms.tuning.retune_watch`) re-times the runner-up now and
then; ``state.retune()`` tunes again on demand.

A rule applies to every bucket of a step: ``"dense"``, ``"model"`` (the cost model's
per-bucket choice), or an algorithm (for every bucket the planner compresses at all).

Timing: a step is the wall time between the hook's calls for bucket 0 of consecutive steps
(DDP launches bucket 0 first): forward, backward, communication, optimizer — all a plan costs.
Error feedback across switches: a bucket moving to another algorithm gets what the old one kept
(``Algorithm.flush_residual_``) once; the hook's own residual stays through a trial's or a
check's dense steps and, once dense is the decision, drains in equal shares.

Modules: this one holds the trial schedule (rounds, what each step runs, when to lock);
:mod:`comms.tuning.autotune_rules` the statistics, :mod:`comms.tuning.autotune_screen` the
rules never tried, :mod:`comms.tuning.retune_watch` the watchdog, :mod:`comms.tuning.step_seconds`
the agreed timings, :mod:`comms.tuning.autotune_state` checkpointing,
:mod:`comms.tuning.autotune_leader` the standing plan before the lock and
:mod:`comms.tuning.autotune_report` what is printed.

Example (``retune()`` on every rank before the same step)::

    >>> state = comms.register(ddp_model, "powersgd:rank=1")   # auto + autotune by default
    >>> ... train 40 steps ...
    >>> print(state.plan)        # per-bucket table, the trial table, the locked rule, its cost
    >>> state.retune()           # tune again
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Callable, Sequence

from ..algorithms import DENSE
from .autotune_report import format_tuner, lock_summary
from .autotune_rules import MIN_GAIN_S, DecisionRules, beats, choose_rule
from .autotune_screen import round_rules, screen_rules
from .autotune_state import load_tuner_state, tuner_state
from .retune_watch import Watchdog
from .step_seconds import MAX_STEP_SECONDS, MIN_STEP_SECONDS, check_step_seconds

# the step-seconds names are re-exported: the timings the tuner decides on are checked there
__all__ = ["Autotuner", "check_step_seconds", "choose_rule", "DENSE", "MODEL", "MAX_STEP_SECONDS",
           "MIN_STEP_SECONDS"]

logger = logging.getLogger(__name__)

MODEL = "model"


def medians(t) -> list[tuple[str, float, int]]:
    """``(rule, median seconds or nan, samples)`` of every rule of ``t``'s trial phase so far."""
    return [(r, statistics.median(t._samples[r]) if t._samples[r] else math.nan, len(t._samples[r]))
            for r in t.trials]


def _fraction(name: str, value, closed: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (0 <= value <= 1 if closed else 0 <= value < 1):
        raise ValueError(f"{name} must be in [0, 1{']' if closed else ')'}, got {value!r}")
    return float(value)


def _int_option(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return value


class Autotuner(DecisionRules, Watchdog):
    """Interleaved trial rounds, per-step timing, the agreed decision and the watchdog.

    Args:
        steps_per_trial: steps a rule runs per round (>= 2; in the first round the first
            is not counted).
        trials: compressed rules to try besides all-dense (the cost model's best few).
        prefer_dense: a compressed rule must be at least this fraction faster than dense.
        candidates: explicit rules to try instead of the cost model's proposals (``"dense"``
            is always tried first).
        max_steps: the tuning budget in steps (rounds stop before exceeding it).
        min_rounds: rounds before an early decision (>= 1).
        watch_every: steps between watchdog checks after the lock (0: no watchdog).
        drift: relative change of the locked plan's step time that triggers a new tuning.
        tie: winners whose mean step is within this fraction of the fastest one's (or within
            twice it and inside 3 standard errors) are a tie, decided by ``preference``.
        decisive: the separation (fraction of a step) between every sample of two rules that
            settles them before ``min_rounds`` (from round 2 on): the early lock, and dense's
            retirement from the trial rounds; 0 turns both off.
        screen: try a rule only where the model predicts it saves this share of the margin
            over dense's step (0: try all; :mod:`comms.tuning.autotune_screen`).

    Attributes:
        preference: ``None`` (the trial order) or ``fn(rule) -> sort key``: which of tied
            winners to lock (must give the same key on every rank).
        timing: ``None``, or ``fn(rule, seconds) -> seconds`` applied to each locally measured
            step time before the agreement (tests inject timings with it).
        rule: the rule in force this step (a trial's, the watchdog's runner-up, or the lock).
        locked: a decision is made; ``decision`` holds it.
        table: ``[(rule, median seconds or nan, steps counted)]`` of the last trial phase.
        tuning_steps, tuning_cost_s: steps the last trial phase took, and their time beyond
            what the locked rule would have taken (agreed numbers).
        reason: why the last lock chose its rule (the test that decided), for the log.
        tunings: how many trial phases ran (the watchdog and ``retune`` start new ones).
        screened: ``{rule: predicted seconds saved per step}`` of the rules not tried.
        count_from: steps before it are never counted (the compressor's warm-up ramp: its
            milder variants' steps would time a different plan); set by the planner.
    """

    def __init__(self, steps_per_trial: int = 2, trials: int = 3, prefer_dense: float = 0.03,
                 candidates: Sequence[str] | None = None, *, max_steps: int = 40,
                 min_rounds: int = 4, watch_every: int = 200, drift: float = 0.25,
                 tie: float = 0.03, decisive: float = 0.10, screen: float = 0.0):
        if isinstance(steps_per_trial, bool) or not isinstance(steps_per_trial, int):
            raise TypeError(f"autotune_steps must be an int, got {steps_per_trial!r}")
        if steps_per_trial < 2:
            raise ValueError(f"autotune_steps must be >= 2 (the first step of a trial is not "
                             f"counted), got {steps_per_trial!r}")
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
            raise ValueError(f"trials must be an int >= 0, got {trials!r}")
        prefer_dense = _fraction("prefer_dense", prefer_dense)
        if candidates is not None and (isinstance(candidates, str)
                                       or not all(isinstance(c, str) for c in candidates)):
            raise TypeError(f"candidates must be a list of rule names, got {candidates!r}")
        self.max_steps = _int_option("autotune max_steps", max_steps, steps_per_trial)
        self.min_rounds = _int_option("autotune min_rounds", min_rounds, 1)
        self.watch_every = _int_option("autotune watch_every", watch_every, 0)
        if not isinstance(drift, (int, float)) or not drift > 0:
            raise ValueError(f"autotune drift must be > 0, got {drift!r}")
        self.tie = _fraction("autotune tie", tie)
        self.decisive = _fraction("autotune decisive", decisive)
        self.screen = _fraction("autotune screen", screen, closed=True)
        self.preference: Callable[[str], object] | None = None
        self.steps = steps_per_trial
        self.n_trials = trials
        self.prefer_dense = float(prefer_dense)
        self.drift = float(drift)
        self.candidates = None if candidates is None else list(candidates)
        self.timing: Callable[[str, float], float] | None = None
        self.tunings = 0
        self.count_from = 0
        self.reset()

    def reset(self) -> None:
        """Forget the decision and the measurements; the next step starts a trial phase."""
        self.locked = False
        self.rule: str | None = None
        self.decision: str | None = None
        self.start: int | None = None
        self.trials: list[str] = []
        self.table: list[tuple[str, float, int]] = []
        self.tuning_steps = 0
        self.tuning_cost_s = 0.0
        self.reason = ""
        self._active: list[str] = []
        self._dense_retired = False  # dense lost decisively: no more dense trial steps
        self._beat_dense: set[str] = set()  # the rules that had beaten dense then: winners for good
        self._rounds = 0
        self._samples: dict[str, list[float]] = {}
        self._by_round: dict[str, dict[int, list[float]]] = {}  # rule -> round -> its samples
        self._round: list[tuple[int, str, bool]] = []  # (step, rule, counted) of this round
        self._phase_steps: list[tuple[str, float]] = []  # agreed (rule, seconds) of the phase
        self._durations: dict[int, float] = {}
        self._last: tuple[int, float] | None = None  # (step, clock) of the last bucket-0 call
        self._recent: deque = deque(maxlen=8)  # locked steps before the next watchdog check
        self._check: list[tuple[int, str]] = []  # the watchdog's (step, rule) schedule
        self._locked_at: int | None = None
        self._winners: list[str] = []  # the rules that beat dense at the last round's end
        self._leader_round, self._offered = 0, None  # comms.tuning.autotune_leader's last
        self._lead: str | None = None  # "due": dense's first-round steps run alone; then "done"
        self.screened: dict[str, float] = {}

    # -- per step -------------------------------------------------------------------------
    def begin_step(self, step: int, now: float, propose: Callable[[], list[str]],
                   agree: Callable[[list[float]], list[float]],
                   predict: Callable[[], dict[str, float]] | None = None) -> str:
        """Called at bucket 0 of every tuned step, on every rank; returns this step's rule.

        ``propose()`` gives the compressed rules ranked best first (identical on all ranks);
        ``agree(values)`` returns the element-wise MAX over ranks (a collective: called at
        the end of each trial round and of each watchdog check, on every rank alike);
        ``predict()`` gives ``{rule: seconds per step it saves against all-dense}`` as the
        cost model predicts them (identical on all ranks; ``None``: no screening).
        """
        last, self._last = self._last, (step, now)
        if last is not None and last[0] == step - 1 and (last[0] >= self.count_from or self._lead == "due"):
            seconds = now - last[1]
            if self.timing is not None and self.rule is not None:
                seconds = float(self.timing(self.rule, seconds))
            self._durations[step - 1] = seconds
        if self.locked:
            return self._watch(step, agree)
        if self.start is None:
            proposed = self.candidates if self.candidates is not None else propose()[: self.n_trials]
            self.trials = [DENSE] + [r for r in dict.fromkeys(proposed) if r != DENSE]
            self._active = list(self.trials)
            self._samples = {r: [] for r in self.trials}
            self.start = step
            self.tunings += 1
            self._lead = "due" if self.screen > 0 and predict is not None and len(self.trials) > 1 else None
            logger.debug("autotune: rules %s from step %d, rounds of %d steps each",
                         self.trials, step, self.steps)
        if not self._round or step > self._round[-1][0]:
            if self._round:
                if self._lead == "due":
                    self._record_round(agree, advance=False)
                    screen_rules(self, predict)
                else:
                    self._end_round(agree)
                if self.locked:
                    return self._watch(step, agree)
            self._round = self._schedule(step)
        self.rule = next(r for s, r, _ in self._round if s == step)
        return self.rule

    def _schedule(self, step: int) -> list[tuple[int, str, bool]]:
        """The next round from ``step``: ``(step, rule, counted)``, every live rule for
        ``self.steps`` steps in turn. In a phase's first round the first step of each rule is
        not counted (the rule's first steps allocate its buffers); from the second round on
        every step counts (see the module docstring)."""
        every, rules = self._rounds >= 1, round_rules(self)
        return [(step + i * self.steps + j, r, every or j > 0)
                for i, r in enumerate(rules) for j in range(self.steps)]

    def _end_round(self, agree) -> None:
        """Agree on the round's step times (collective), judge every rule, and lock when the
        phase is decided or its budget is spent."""
        self._record_round(agree)
        rounds, dense = self._rounds, self._samples[DENSE]
        undecided = self._undecided(rounds, dense)
        winners = [r for r in self._active if r != DENSE and dense and self._samples[r]
                   and self._wins(r)]
        self._winners = winners
        keep, undecided, early = self._keep(winners, undecided, rounds, dense)
        self._retire_dense(keep, rounds, dense)
        live = [r for r in self._active if r != DENSE and r in keep]
        self._active = live if self._dense_retired else [DENSE] + live
        used = len(self._phase_steps)
        next_round = len(self._active) * self.steps
        if rounds >= self.min_rounds and not undecided:
            self._lock(winners, "every rule decided")
        elif early:
            self._lock(winners, f"decisive by {self.decisive:.0%}, locked in round {rounds}")
        elif used + next_round > self.max_steps:
            self._lock(winners, f"the {self.max_steps}-step budget was spent")
        elif len(self._active) <= 1:
            self._lock(winners, "no other rule left in play")

    def _record_round(self, agree, advance: bool = True) -> None:
        vals = list(agree([self._durations.get(s, math.nan) for s, _, _ in self._round]))
        for (s, r, counted), v in zip(self._round, vals):
            self._phase_steps.append((r, v))
            if counted and math.isfinite(v):
                self._samples[r].append(v)
                self._by_round.setdefault(r, {}).setdefault(self._rounds, []).append(v)
        self._durations.clear()
        self._rounds += advance

    def _undecided(self, rounds: int, dense: list[float]) -> list[str]:
        """The compressed rules in play that neither won nor were dropped this round."""
        undecided = []
        for r in self._active:
            if r == DENSE:
                continue
            s = self._samples[r]
            if not s:  # nothing counted yet (its steps were the warm-up ramp's): not judged
                undecided.append(r)
                continue
            if dense and rounds >= 2 and min(s) > max(dense):
                continue  # slower than every dense step, two samples each at least: dropped
            if dense and rounds >= self.min_rounds and min(s) > max(dense) * (1 - self.prefer_dense):
                continue  # none of its steps beat dense by the margin: it cannot win
            if self._paired_loses(r):
                continue  # paired by round, surely not prefer_dense faster: its rounds go to the rest
            if not (dense and self._wins(r)):
                undecided.append(r)
        return undecided

    def _keep(self, winners: list[str], undecided: list[str], rounds: int,
              dense: list[float]) -> tuple[list[str], list[str], bool]:
        """``(keep, undecided, early)``: the rules that stay in play, the undecided ones, and
        whether a decisive winner locks before ``min_rounds``. Between winners :meth:`_pick`
        decides; they stay in play while their ranges overlap or while they are tied with
        the pick."""
        if not winners:
            return undecided, undecided, False
        best, ties = self._pick(winners)
        bmax = max(self._samples[best])
        if rounds >= self.min_rounds:
            undecided = undecided + [r for r in winners if r != best and min(self._samples[r]) <= bmax]
            return [best] + undecided + ties, undecided, False
        # a few samples each cannot separate near plans yet: every winner stays, unless the
        # best beats dense decisively and every other live rule is decisively slower
        keep = winners + undecided
        early = (self.decisive > 0 and rounds >= 2
                 and beats(self._samples[best], dense, self.decisive)
                 and all(beats(self._samples[best], self._samples[r], self.decisive)
                         for r in keep if r != best))
        return keep, undecided, early

    def _retire_dense(self, keep: list[str], rounds: int, dense: list[float]) -> None:
        """Dense has lost decisively to every rule still in play: its samples stay (every rule
        is still judged against them), its trial steps stop — on a slow link each one costs
        the compressed step time again, and the rounds left only separate the compressed
        plans. The rules in play then keep their win over dense for good."""
        margin = max(self.decisive, self.prefer_dense)  # a retired dense's rules win for good
        if (not self._dense_retired and self.decisive > 0 and rounds >= 2 and keep
                and all(beats(self._samples[r], dense, margin) for r in keep)):
            self._dense_retired = True
            self._beat_dense = set(keep)

    def _lock(self, winners, why: str, reason: str | None = None) -> None:
        self.table = medians(self)
        decision = self._pick(winners)[0] if winners else DENSE
        self.reason = reason or (f"{self._win_reason(decision)}; {why}" if winners else
                                 f"no compressed rule beat dense's median by {self.prefer_dense:.0%} and "
                                 f"{MIN_GAIN_S * 1e3:g} ms with confidence; {why}")
        self.decision = self.rule = decision
        self.locked = True
        score = dict((r, s) for r, s, _ in self.table)[decision]
        finite = [v for _, v in self._phase_steps if math.isfinite(v)]
        self.tuning_steps = len(self._phase_steps)
        self.tuning_cost_s = max(0.0, sum(finite) - len(finite) * score) if math.isfinite(score) else 0.0
        # every agreed trial step, in order: what bench/autotune_replay.py --phases replays
        logger.debug("autotune phase steps: %s", " ".join(f"{r}:{v * 1e3:.1f}" for r, v in self._phase_steps))
        self._round = []
        self._recent.clear()
        self._check = []
        self._locked_at = None

    # -- after the lock: the watchdog (comms.tuning.retune_watch) ----------------------------
    def _restart(self, step: int) -> str:
        """A new trial phase from ``step`` with the same rules (the clock keeps running)."""
        trials, last = list(self.trials), self._last
        self.reset()
        self._last = last
        self.start = step
        self.trials = trials
        self._active = list(trials)
        self._samples = {r: [] for r in trials}
        self._by_round = {}
        self.tunings += 1
        self._round = self._schedule(step)
        self.rule = self._round[0][1]
        return self.rule

    # -- checkpointing and printing ---------------------------------------------------------
    def state_dict(self) -> dict:
        """The decision as plain values (:func:`comms.tuning.autotune_state.tuner_state`)."""
        return tuner_state(self)

    def load_state_dict(self, sd: dict) -> None:
        """A locked decision is kept (no re-tuning); an unfinished trial phase starts afresh."""
        load_tuner_state(self, sd)

    def lock_summary(self) -> str:
        """One line: what was locked, against dense, why, and the tuning's cost in steps."""
        return lock_summary(self)

    def __str__(self) -> str:
        return format_tuner(self)
