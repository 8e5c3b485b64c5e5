"""``Autotuner``: the measured half of ``algorithm="auto"``.

The cost model only *proposes*. From the first compressed iteration the tuner runs whole-step
plans ("rules") — always all-dense, then the cost model's best few proposals — **interleaved
in rounds** (dense, A, B, dense, A, B, ...; each rule for ``steps_per_trial`` steps; in the
first round the first step of each is not counted because a rule's first steps allocate, from
the second round every step counts: a block's first step measured within 1-4% of the next
ones), times every step, agrees on the timings across ranks after each round (one small
allgather, MAX per step) and decides when **the data decides**:

* a rule whose every sample is slower than every dense sample is dropped — from round 2, two
  samples each at least: one slow step must not end a plan's trial (at 10 Gb/s one slow
  round-1 sample did, for a top-k plan 10% faster than dense, in 4 of 5 tunings);
* a compressed rule *wins* when its median beats dense's by ``prefer_dense`` (3%) and by
  :data:`MIN_GAIN_S`, and either every one of its samples is faster than every dense sample
  with a mean gain beyond 3 standard errors of the difference (the measured step-to-step
  noise), or, from :data:`RANK_MIN_SAMPLES` (6) samples each, its samples are faster in at
  least :data:`RANK_WIN` (85%) of all pairs with dense's (a rank test a stray step cannot
  overturn; before it, a plan 15% faster than dense over 9 samples each lost to one overlap),
  or, from :data:`PAIRED_MIN_ROUNDS` (4) rounds, **paired by round**: the mean of
  ``log(rule / dense)`` over the rounds that timed both (seconds apart, so the load both
  saw cancels) is below ``log(1 - prefer_dense)`` and :data:`PAIRED_T` (3) standard errors
  below 0 — standard errors of at least the spread pooled over the compressed rules still in
  play (:data:`PAIRED_POOLED`: one rule's spread from 4 rounds has 3 degrees of freedom, and with
  its own spread 3 standard errors locked an equal plan in 22 of 400 simulated tunings). At
  10 Gb/s, 2 ranks, the steps of two interleaved plans correlate by ~0.5 on this VM (per-step
  spread ~10%; paired log-ratio spread 8.3% where the unpaired difference has 12.7%), so the
  paired test tells a 10% faster plan in 40 steps where the unpaired ones often cannot
  (bench/results/autotune_noise_10gbit_s17.md);
* a rule that **surely cannot win** is dropped: from :data:`PAIRED_MIN_ROUNDS` rounds, its
  mean paired log-ratio lies :data:`PAIRED_DROP_T` (2) standard errors above
  ``log(1 - prefer_dense)``; its steps go to the rules that still can win, and it no longer
  holds the phase open;
* tuning stops when no undecided rule is left after at least
  ``min_rounds`` (4) rounds, or when the
  next round would exceed ``max_steps`` (default 40 steps): then the fastest *winning* rule is
  locked, and dense when none won — an unclear result never compresses. Simulated with
  three candidates as fast as dense and +-20% uniform step noise, at most 4 of 100 seeded
  tunings may lock a compressed rule (tests/unit/test_autotuner_rules.py; 8 of 400 measured
  with the rank test, 1 of 400 before it and the round-2 drop; 10 of 400 with the paired
  test; 6 of 400 with today's rules). Replayed on measured 10 Gb/s steps
  (``bench/autotune_replay.py``, 400 tunings per row, a candidate ``a`` beside one 30%
  slower; bench/results/autotune_replay_s19.md, session 18's rules in brackets): ``a`` as
  fast as dense is locked in 7 (14), 3% slower in 0 (2), 6.7% faster in 284 (163), 10%
  faster in 397 (289), 12% faster in 400 (356);
* **a decisive result stops earlier**: from round 2 on, when the fastest winner's every
  sample beats every dense sample by ``decisive`` (10%) and every other rule is dropped or
  has every sample slower than every sample of that winner by ``decisive``, it is locked
  before ``min_rounds``. Near plans (within ``decisive`` of each other or of dense) still
  get ``min_rounds``; on a 1 Gb/s link, where dense is 1.5-3x slower than the compressed plans,
  this halves the tuning steps, and every dense trial step there costs the compressed step
  time again;
* **dense retires once beaten decisively**: from round 2 on, when every rule still in play
  beats dense that way, dense runs no more trial steps (its samples still judge every rule)
  and the remaining rounds only separate the compressed plans — on a 1 Gb/s link the rounds
  between near compressed plans (qsgd8's allgather / two_phase / shared_scale) no longer pay
  a dense step each. Those rules keep their win over dense (:data:`RETIRED_DENSE_WINS_STAY`):
  with no dense steps left to pair their later steps with, a load burst on those must not
  turn a won phase into a dense lock.

Interleaving matters on a shared machine: a load burst hits every rule of a round instead of
one rule's whole block. Every rank runs the same deterministic decision on the same agreed
numbers, so every rank adopts the SAME plan (a plan that differed between ranks would mismatch
collectives).

**Watchdog.** After the lock, every ``watch_every`` steps (default 200) the runner-up (dense
when a compressed plan is locked, else the best compressed rule) runs for
``steps_per_trial`` steps; the agreed comparison with the locked plan's recent steps triggers
a new tuning when the runner-up now wins, or when the locked plan's recent median got slower
than its tuned score by more than ``drift`` (25%) and 5 ms (load, link changes). ``state.retune()`` tunes
again on demand.

A rule applies to every bucket of a step: ``"dense"`` (plain allreduce everywhere),
``"model"`` (the cost model's per-bucket choice), or an algorithm name (that algorithm for
every bucket the planner would compress at all; small and 1-D buckets stay dense).

Timing. A step's time is the wall time between the hook's calls for bucket 0 of consecutive
steps (DDP launches bucket 0 first, after the previous step's futures were waited for), so it
spans a whole training step — forward, backward, communication, optimizer — and sees
everything a plan costs. Error feedback across switches: when a bucket moves to another
algorithm, the hook adds what the old algorithm kept (``Algorithm.flush_residual_``, e.g.
two_phase's owner residual) into the bucket once; the hook's own residual stays through the
dense steps of a trial or a watchdog check (compression comes back) and, once dense is the
decision, goes out in 8 equal shares (``comms.hook.RESIDUAL_DRAIN_STEPS``): no gradient mass
is lost and none arrives as a burst.

Example::

    >>> state = comms.register(ddp_model, "powersgd:rank=1")   # auto + autotune by default
    >>> ... train 40 steps ...
    >>> print(state.plan)        # per-bucket table, the trial table, the locked rule, its cost
    >>> state.retune()           # on every rank at the same step: tune again

.. warning::
    ``retune()`` must be called on every rank before the same step.

Why one module of ~500 lines: the trial rounds, the decision rules, the watchdog and their
checkpointing share one schedule (step -> rule) that must be identical on every rank.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Callable, Sequence

from .algorithms import DENSE
from .deadline import advice

__all__ = ["Autotuner", "check_step_seconds", "choose_rule", "DENSE", "MODEL", "MIN_GAIN_S", "MAX_STEP_SECONDS", "MIN_STEP_SECONDS",
           "COUNT_EVERY_STEP_FROM", "PAIRED_DROP_T", "PAIRED_MIN_ROUNDS", "PAIRED_POOLED", "PAIRED_T", "RANK_MIN_SAMPLES", "RANK_WIN",
           "RETIRED_DENSE_WINS_STAY"]

logger = logging.getLogger(__name__)

MODEL = "model"

# a compressed plan must also save at least this much per step: below it, a few timed steps
# on a shared CPU cannot tell a real gain from scheduling noise
MIN_GAIN_S = 1e-3


def _int_option(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return value


# no step of any training lasts this long: an agreed value beyond it is not a timing
MAX_STEP_SECONDS = 1e6
# nor this short (a step runs a backward and a collective: microseconds at the least); gloo's
# garbage after a peer died is often zeros, and a zero timing reached the rules' log-ratios
# as "math domain error" (CI, tests/dist/test_stuck_rank.py, topk auto/during trials-kill)
MIN_STEP_SECONDS = 1e-9


def check_step_seconds(values: list[float], what: str) -> list[float]:
    """``values`` (agreed step seconds, NaN = no sample) if each is NaN or in
    ``[MIN_STEP_SECONDS, MAX_STEP_SECONDS)``; else raise.

    Once a peer has died, gloo can hand a collective back with garbage instead of an error;
    decided on, garbage timings fail deep in the rules (``statistics`` overflows on 1e300)
    with a message that names nothing.

    Raises:
        RuntimeError: ``"<what> returned ... : a peer died or disconnected ...; <advice>"``,
            the advice (restart from the last checkpoint) every failed collective ends with.
    """
    bad = [v for v in values if not math.isnan(v) and not MIN_STEP_SECONDS <= v < MAX_STEP_SECONDS]
    if bad:
        raise RuntimeError(f"{what} returned {bad[0]!r} where step seconds belong: a peer died or "
                           "disconnected (gloo can hand back garbage instead of an error); this "
                           f"step's results are discarded; {advice()}")
    return values


#: the rank test of :meth:`Autotuner._wins`: from this many samples of each rule ...
RANK_MIN_SAMPLES = 6
#: ... a rule whose samples are faster in at least this fraction of all pairs with dense's wins.
#: With nothing to tell them apart, 6 / 7 / 8 samples each reach it with probability 2.1% /
#: 1.3% / 0.7% (Mann-Whitney's U); one stalled step among 7 still leaves 86%. Simulated
#: (400 seeded tunings, 3 candidates as fast as dense): 8 locked a compressed plan under +-20%
#: uniform noise, 7 under +-5% with a 10% chance of a +30% stall per step (the disjoint rule
#: alone: 4 and 5); a plan 10% faster than dense under those stalls was locked in 183 of 200
#: tunings (119 before), one 7% faster under +-5% noise in 198 of 200 (129)
RANK_WIN = 0.85

#: the paired test of :meth:`Autotuner._wins`: from this many rounds that timed both rules ...
PAIRED_MIN_ROUNDS = 4
#: ... the mean per-round ``log(rule / dense)`` must lie this many standard errors below 0
PAIRED_T = 3.0
#: the paired test takes at least the spread pooled over the compressed rules in play (see
#: :meth:`Autotuner._paired_sd`)
PAIRED_POOLED = True
#: a rule whose mean per-round ``log(rule / dense)`` lies this many standard errors above
#: ``log(1 - prefer_dense)`` (from :data:`PAIRED_MIN_ROUNDS` rounds) is dropped: it cannot win
PAIRED_DROP_T = 2.0
#: the round (0-based, per trial phase) from which every trial step is counted (before it,
#: the first step of each rule's block is not: it allocates)
COUNT_EVERY_STEP_FROM = 1
#: a rule that beat dense decisively when dense retired from the trial rounds keeps that win:
#: dense runs no more steps to pair its later ones with, so a load burst on those must not
#: undo it (``False``: session 25's rules, where it did — at 10 Gb/s a burst in round 4 lifted
#: sign's allgather, 1.37x dense over 17 steps, above dense's fastest early step, and the
#: tuning ended on dense: bench/results/autotune_10gbit_s26.md)
RETIRED_DENSE_WINS_STAY = True


def _faster_pairs(fast: list[float], slow: list[float]) -> float:
    """The fraction of pairs ``(a, b)`` of ``fast`` x ``slow`` with ``a < b`` (ties count
    half): the probability of superiority, Mann-Whitney's U over ``len(fast) * len(slow)``."""
    wins = sum((a < b) + 0.5 * (a == b) for a in fast for b in slow)
    return wins / (len(fast) * len(slow))


def _stderr(a: list[float], b: list[float]) -> float:
    """The standard error of ``mean(a) - mean(b)`` (each at least 2 samples): the measured
    step-to-step noise every decision rule compares a gain with."""
    return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


class Autotuner:
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
        tunings: how many trial phases ran (the watchdog and ``retune`` start new ones).
        count_from: steps before it are never counted (the compressor's warm-up ramp: its
            milder variants' steps would time a different plan); set by the planner.
    """

    def __init__(self, steps_per_trial: int = 2, trials: int = 3, prefer_dense: float = 0.03,
                 candidates: Sequence[str] | None = None, *, max_steps: int = 40,
                 min_rounds: int = 4, watch_every: int = 200, drift: float = 0.25,
                 tie: float = 0.03, decisive: float = 0.10):
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
        self.max_steps = _int_option("autotune max_steps", max_steps, steps_per_trial)
        self.min_rounds = _int_option("autotune min_rounds", min_rounds, 1)
        self.watch_every = _int_option("autotune watch_every", watch_every, 0)
        if not isinstance(drift, (int, float)) or not drift > 0:
            raise ValueError(f"autotune drift must be > 0, got {drift!r}")
        if not isinstance(tie, (int, float)) or not 0 <= tie < 1:
            raise ValueError(f"autotune tie must be in [0, 1), got {tie!r}")
        self.tie = float(tie)
        if not isinstance(decisive, (int, float)) or not 0 <= decisive < 1:
            raise ValueError(f"autotune decisive must be in [0, 1), got {decisive!r}")
        self.decisive = float(decisive)
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

    # -- per step -------------------------------------------------------------------------
    def begin_step(self, step: int, now: float, propose: Callable[[], list[str]],
                   agree: Callable[[list[float]], list[float]]) -> str:
        """Called at bucket 0 of every tuned step, on every rank; returns this step's rule.

        ``propose()`` gives the compressed rules ranked best first (identical on all ranks);
        ``agree(values)`` returns the element-wise MAX over ranks (a collective: called at
        the end of each trial round and of each watchdog check, on every rank alike).
        """
        last, self._last = self._last, (step, now)
        if last is not None and last[0] == step - 1 and last[0] >= self.count_from:
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
            logger.debug("autotune: rules %s from step %d, rounds of %d steps each",
                         self.trials, step, self.steps)
        if not self._round or step > self._round[-1][0]:
            if self._round:
                self._end_round(agree)
                if self.locked:
                    return self._watch(step, agree)
            self._round = self._schedule(step)
        self.rule = next(r for s, r, _ in self._round if s == step)
        return self.rule

    def _schedule(self, step: int) -> list[tuple[int, str, bool]]:
        """The next round from ``step``: ``(step, rule, counted)``, every live rule for
        ``self.steps`` steps in turn. In a phase's first round the first step of each rule is
        not counted (the rule's first steps allocate its buffers); from the second round on,
        from round :data:`COUNT_EVERY_STEP_FROM`, every step counts: measured at 10 Gb/s
        (qsgd4, four rules in blocks of 3 steps, two runs of 10-11 rounds), a block's first
        step was within -0.9% .. +3.7% of the block's other steps (standard errors 2-4%)
        while round 1's first steps were up to ~2x (bench/autotune_first_step.py,
        bench/results/autotune_first_step_10gbit_s19.md). Twice the samples from the same
        steps."""
        every = self._rounds >= COUNT_EVERY_STEP_FROM
        return [(step + i * self.steps + j, r, every or j > 0)
                for i, r in enumerate(self._active) for j in range(self.steps)]

    def _end_round(self, agree) -> None:
        vals = list(agree([self._durations.get(s, math.nan) for s, _, _ in self._round]))
        for (s, r, counted), v in zip(self._round, vals):
            self._phase_steps.append((r, v))
            if counted and math.isfinite(v):
                self._samples[r].append(v)
                self._by_round.setdefault(r, {}).setdefault(self._rounds, []).append(v)
        self._durations.clear()
        self._rounds += 1
        rounds = self._rounds
        dense = self._samples[DENSE]
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
        winners = [r for r in self._active if r != DENSE and dense and self._samples[r]
                   and self._wins(r)]
        # between winners _pick decides; they stay in play while their ranges overlap or while
        # they are tied with the pick
        early = False
        if winners:
            best, ties = self._pick(winners)
            bmax = max(self._samples[best])
            if rounds >= self.min_rounds:
                undecided += [r for r in winners if r != best and min(self._samples[r]) <= bmax]
                keep = [best] + undecided + ties
            else:
                # a few samples each cannot separate near plans yet: every winner stays, unless
                # the best beats dense decisively and every other live rule is decisively slower
                keep = winners + undecided
                early = (self.decisive > 0 and rounds >= 2
                         and self._beats(self._samples[best], dense, self.decisive)
                         and all(self._beats(self._samples[best], self._samples[r], self.decisive)
                                 for r in keep if r != best))
        else:
            keep = undecided
        # dense has lost decisively to every rule still in play: its samples stay (every rule
        # is still judged against them), its trial steps stop — on a slow link each one costs
        # the compressed step time again, and the rounds left only separate the compressed plans
        if (not self._dense_retired and self.decisive > 0 and rounds >= 2 and keep
                and all(self._beats(self._samples[r], dense, self.decisive) for r in keep)):
            self._dense_retired = True
            if RETIRED_DENSE_WINS_STAY:
                self._beat_dense = set(keep)
        live = [r for r in self._active if r != DENSE and r in keep]
        self._active = live if self._dense_retired else [DENSE] + live
        used = len(self._phase_steps)
        next_round = len(self._active) * self.steps
        if (rounds >= self.min_rounds and not undecided) or early \
                or used + next_round > self.max_steps or len(self._active) <= 1:
            self._lock(winners)

    def _wins(self, rule: str) -> bool:
        """``rule``'s median beats dense's by the margins, and either every sample of it beats
        every dense sample with a mean gain beyond 3 standard errors of the difference (the
        measured step-to-step noise), or — from :data:`RANK_MIN_SAMPLES` samples each — at
        least :data:`RANK_WIN` of all (rule, dense) sample pairs have the rule faster (a rank
        test that one stray step, a 100 ms stall, cannot overturn as it does the other two),
        or — from :data:`PAIRED_MIN_ROUNDS` rounds that timed both — the paired test
        (:meth:`_paired_wins`). A rule that beat dense decisively when dense retired from the
        rounds has won for good (:data:`RETIRED_DENSE_WINS_STAY`)."""
        if rule in self._beat_dense:
            return True  # beat dense decisively when dense retired (RETIRED_DENSE_WINS_STAY)
        s, dense = self._samples[rule], self._samples[DENSE]
        d = statistics.median(dense)
        m = statistics.median(s)
        if not m < min(d * (1 - self.prefer_dense), d - MIN_GAIN_S):
            return False
        if min(len(s), len(dense)) >= RANK_MIN_SAMPLES and _faster_pairs(s, dense) >= RANK_WIN:
            return True
        if self._paired_wins(rule):
            return True
        if not max(s) < min(dense):
            return False
        if len(s) < 2 or len(dense) < 2:
            return True
        return statistics.fmean(dense) - statistics.fmean(s) > 3 * _stderr(s, dense)

    def _paired_wins(self, rule: str) -> bool:
        """Over the rounds that timed both ``rule`` and dense (at least
        :data:`PAIRED_MIN_ROUNDS`), the per-round ``log(mean rule step / mean dense step)``
        has its mean below ``log(1 - prefer_dense)`` and :data:`PAIRED_T` standard errors below
        0. A round's steps are seconds apart: the load that moves both cancels in the ratio
        (slow drifts of this shared machine that make the unpaired spread)."""
        x = self._paired_log_ratios(rule)
        if len(x) < PAIRED_MIN_ROUNDS:
            return False
        mean = statistics.fmean(x)
        return mean < math.log(1 - self.prefer_dense) and -mean > PAIRED_T * self._paired_sd(x) / math.sqrt(len(x))

    def _paired_sd(self, x: list[float]) -> float:
        """The spread of one rule's per-round log-ratios ``x``: their own standard deviation, or
        with :data:`PAIRED_POOLED` at least the one pooled over the compressed rules still in
        play that were timed in two rounds or more (each about its own mean: the rules' gains
        differ, their round-to-round noise is the machine's). From 4 rounds one rule's spread
        has 3 degrees of freedom and comes out at half the true one in 1 tuning of 10: the
        pooled one, over 3 rules, guards the test against that without letting a quiet rule
        lower a noisy one's. Dropped rules leave the pool: a plan 30% slower with stalls (top-k's
        two_phase at 10 Gb/s) has a spread of its own that must not hide a clear winner."""
        own = statistics.stdev(x)
        if not PAIRED_POOLED:
            return own
        ss, dof = 0.0, 0
        for r in self._active:
            y = self._paired_log_ratios(r) if r != DENSE else []
            if len(y) >= 2:
                m = statistics.fmean(y)
                ss += sum((v - m) ** 2 for v in y)
                dof += len(y) - 1
        return max(own, math.sqrt(ss / dof)) if dof else own

    def _paired_loses(self, rule: str) -> bool:
        """Over at least :data:`PAIRED_MIN_ROUNDS` rounds that timed both ``rule`` and dense,
        the mean per-round ``log(mean rule step / mean dense step)`` lies
        :data:`PAIRED_DROP_T` standard errors above ``log(1 - prefer_dense)``: the rule is
        surely not the margin faster than dense, so it cannot win; dropping it leaves the
        remaining budget to the rules that still can (a round of 4 rules costs twice one of 2)."""
        x = self._paired_log_ratios(rule)
        if len(x) < PAIRED_MIN_ROUNDS:
            return False
        se = statistics.stdev(x) / math.sqrt(len(x))  # its own spread: a drop needs no guard
        return statistics.fmean(x) - PAIRED_DROP_T * se > math.log(1 - self.prefer_dense)

    def _paired_log_ratios(self, rule: str) -> list[float]:
        """Per round that timed both ``rule`` and dense: ``log(mean rule step / mean dense step)``."""
        mine, dense = self._by_round.get(rule, {}), self._by_round.get(DENSE, {})
        return [math.log(statistics.fmean(mine[k]) / statistics.fmean(dense[k]))
                for k in sorted(set(mine) & set(dense))]

    @staticmethod
    def _beats(fast: list[float], slow: list[float], margin: float) -> bool:
        """Every sample of ``fast`` beats every sample of ``slow`` by ``margin`` (a fraction of
        the slow sample), and the mean gain beyond that margin exceeds 3 standard errors."""
        if len(fast) < 2 or len(slow) < 2 or not max(fast) < min(slow) * (1 - margin):
            return False
        return statistics.fmean(slow) * (1 - margin) - statistics.fmean(fast) > 3 * _stderr(fast, slow)

    def _pick(self, winners: list[str]) -> tuple[str, list[str]]:
        """``(pick, ties)``: the fastest winner (mean step), unless others are tied with it —
        their mean within ``tie`` of it, or within ``2 * tie`` and not 3 standard errors away
        (the measured noise); among tied winners the preferred one."""
        mean = {r: statistics.fmean(self._samples[r]) for r in winners}
        fastest = min(winners, key=lambda r: (mean[r], self.trials.index(r)))
        f = mean[fastest]

        def tied(r):
            gap = mean[r] - f
            if gap <= self.tie * f:
                return True
            a, b = self._samples[r], self._samples[fastest]
            if gap > 2 * self.tie * f:
                return False
            if len(a) < 2 or len(b) < 2:
                return True  # no spread measured yet: within 2 * tie stays a tie
            return gap < 3 * _stderr(a, b)

        ties = [r for r in winners if tied(r)]
        if len(ties) == 1:
            return fastest, ties
        key = self.preference if self.preference is not None else self.trials.index
        return min(ties, key=lambda r: (key(r), self.trials.index(r))), ties

    def _lock(self, winners) -> None:
        self.table = [(r, statistics.median(self._samples[r]) if self._samples[r] else math.nan,
                       len(self._samples[r])) for r in self.trials]
        decision = self._pick(winners)[0] if winners else DENSE
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

    # -- after the lock: the watchdog ------------------------------------------------------------
    def _runner_up(self) -> str | None:
        if self.decision != DENSE:
            return DENSE
        rest = [(s, r) for r, s, _ in self.table if r != DENSE and math.isfinite(s)]
        return min(rest)[1] if rest else None

    def _watch(self, step: int, agree) -> str:
        if self._locked_at is None:
            self._locked_at = step
        if self._check:
            if step <= self._check[-1][0]:
                self.rule = dict(self._check)[step]
                return self.rule
            # the check is over (its last step's time is known now): decide, on every rank
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
            if self._should_retune(challenger, recent):
                logger.info("autotune watchdog at step %d: locked %r %.1f ms (tuned %.1f ms), "
                            "runner-up %.1f ms: tuning again", step, self.decision,
                            recent * 1e3, self._score() * 1e3, challenger * 1e3)
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

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"locked": self.locked, "rule": self.decision if self.locked else None,
                "table": [[r, float(s), int(n)] for r, s, n in self.table],
                "tuning_steps": self.tuning_steps, "tuning_cost_s": float(self.tuning_cost_s)}

    def load_state_dict(self, sd: dict) -> None:
        """A locked decision is kept (no re-tuning); an unfinished trial phase starts afresh."""
        if not isinstance(sd, dict) or not isinstance(sd.get("locked"), bool):
            raise TypeError(f"autotune state must be a dict from Autotuner.state_dict(), got {sd!r}")
        if sd["locked"] and not isinstance(sd.get("rule"), str):
            raise TypeError(f"a locked autotune state needs a rule name, got {sd.get('rule')!r}")
        self.reset()
        if sd["locked"]:
            self.locked, self.rule, self.decision = True, sd["rule"], sd["rule"]
            self.table = [(str(r), float(s), int(n)) for r, s, n in sd.get("table", [])]
            self.trials = [r for r, _, _ in self.table]
            self.tuning_steps = int(sd.get("tuning_steps", 0))
            self.tuning_cost_s = float(sd.get("tuning_cost_s", 0.0))

    def __str__(self) -> str:
        if not self.table:
            state = (f"trial phase from step {self.start}: {self.trials}" if self.start is not None
                     else "not started")
            return f"autotune: {state}" + (f", locked {self.decision!r}" if self.locked else "")
        dense = self.table[0][1]
        lines = [f"{'trial':>16} {'step ms':>10} {'steps':>6} {'vs dense':>9}"]
        for rule, s, n in self.table:
            rel = f"{dense / s:>8.2f}x" if math.isfinite(s) and math.isfinite(dense) and s > 0 else f"{'-':>9}"
            lines.append(f"{rule:>16} {s * 1e3:>10.1f} {n:>6} {rel}"
                         + ("   <- locked" if rule == self.decision else ""))
        lines.append(f"autotune: locked {self.decision!r} after {self.tuning_steps} tuning steps "
                     f"(cost {self.tuning_cost_s * 1e3:.0f} ms beyond the locked plan; a compressed "
                     f"plan must beat every dense step and the dense median by "
                     f"{self.prefer_dense:.0%}); tunings so far: {self.tunings}")
        return "\n".join(lines)


def choose_rule(scores: Sequence[tuple[str, float, int]], prefer_dense: float,
                min_gain: float = MIN_GAIN_S) -> str:
    """The fastest compressed rule if its score beats dense by ``prefer_dense`` (relative)
    and by ``min_gain`` seconds, else ``"dense"`` (scores only, no spread: for callers that
    hold one number per rule).

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
