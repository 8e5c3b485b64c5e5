"""The autotuner's statistical rules: when a compressed rule *wins* against dense, when it
surely cannot, and which of several winners to lock.

Every rank runs these on the same agreed step times (the MAX over ranks of each step), so
every rank reaches the same decision. The thresholds were chosen on simulated tunings (three
candidates as fast as dense under +-20% uniform step noise: at most 4 of 100 seeded tunings
may lock a compressed rule, tests/unit/test_autotuner_rules.py) and on measured step times
replayed through the rules (``bench/autotune_replay.py``; 400 tunings per row at 10 Gb/s, 2
ranks, a candidate beside one 30% slower: a candidate as fast as dense is locked in 7, one 3%
slower in 0, one 6.7% faster in 284, 10% faster in 397, 12% faster in 400).
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence

from ..algorithms import DENSE

__all__ = ["MIN_GAIN_S", "RANK_MIN_SAMPLES", "RANK_WIN", "PAIRED_MIN_ROUNDS", "PAIRED_T",
           "PAIRED_DROP_T", "faster_pairs", "stderr", "beats", "choose_rule", "DecisionRules"]

# a compressed plan must also save at least this much per step: below it, a few timed steps
# on a shared CPU cannot tell a real gain from scheduling noise
MIN_GAIN_S = 1e-3

#: the rank test of :meth:`DecisionRules._wins`: from this many samples of each rule ...
RANK_MIN_SAMPLES = 6
#: ... a rule whose samples are faster in at least this fraction of all pairs with dense's wins.
#: With nothing to tell them apart, 6 / 7 / 8 samples each reach it with probability 2.1% /
#: 1.3% / 0.7% (Mann-Whitney's U); one stalled step among 7 still leaves 86%. Simulated
#: (400 seeded tunings, 3 candidates as fast as dense): 8 locked a compressed plan under +-20%
#: uniform noise, 7 under +-5% with a 10% chance of a +30% stall per step (the disjoint rule
#: alone: 4 and 5); a plan 10% faster than dense under those stalls was locked in 183 of 200
#: tunings (119 without the rank test), one 7% faster under +-5% noise in 198 of 200 (129)
RANK_WIN = 0.85

#: the paired test of :meth:`DecisionRules._wins`: from this many rounds that timed both rules ...
PAIRED_MIN_ROUNDS = 4
#: ... the mean per-round ``log(rule / dense)`` must lie this many standard errors below 0
PAIRED_T = 3.0
#: a rule whose mean per-round ``log(rule / dense)`` lies this many standard errors above
#: ``log(1 - prefer_dense)`` (from :data:`PAIRED_MIN_ROUNDS` rounds) is dropped: it cannot win
PAIRED_DROP_T = 2.0


def faster_pairs(fast: list[float], slow: list[float]) -> float:
    """The fraction of pairs ``(a, b)`` of ``fast`` x ``slow`` with ``a < b`` (ties count
    half): the probability of superiority, Mann-Whitney's U over ``len(fast) * len(slow)``."""
    wins = sum((a < b) + 0.5 * (a == b) for a in fast for b in slow)
    return wins / (len(fast) * len(slow))


def stderr(a: list[float], b: list[float]) -> float:
    """The standard error of ``mean(a) - mean(b)`` (each at least 2 samples): the measured
    step-to-step noise every decision rule compares a gain with."""
    return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def beats(fast: list[float], slow: list[float], margin: float) -> bool:
    """Every sample of ``fast`` beats every sample of ``slow`` by ``margin`` (a fraction of
    the slow sample), and the mean gain beyond that margin exceeds 3 standard errors."""
    if len(fast) < 2 or len(slow) < 2 or not max(fast) < min(slow) * (1 - margin):
        return False
    return statistics.fmean(slow) * (1 - margin) - statistics.fmean(fast) > 3 * stderr(fast, slow)


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


class DecisionRules:
    """The rules over a trial phase's samples (a mixin of :class:`comms.tuning.autotune.Autotuner`,
    which holds the state they read: ``_samples`` (rule -> counted step seconds),
    ``_by_round`` (rule -> round -> its samples), ``_active`` (the rules in play),
    ``_beat_dense`` (rules that beat dense decisively when it retired), ``trials``,
    ``prefer_dense``, ``tie`` and ``preference``)."""

    _samples: dict[str, list[float]]
    _by_round: dict[str, dict[int, list[float]]]
    _active: list[str]
    _beat_dense: set
    trials: list[str]
    prefer_dense: float
    tie: float
    preference: Callable[[str], object] | None

    def _wins(self, rule: str) -> bool:
        """``rule``'s median beats dense's by ``prefer_dense`` and :data:`MIN_GAIN_S`, and
        either every sample of it beats every dense sample with a mean gain beyond 3 standard
        errors of the difference (the measured step-to-step noise), or — from
        :data:`RANK_MIN_SAMPLES` samples each — at least :data:`RANK_WIN` of all (rule, dense)
        sample pairs have the rule faster (a rank test that one stray step, a 100 ms stall,
        cannot overturn as it does the other two), or — from :data:`PAIRED_MIN_ROUNDS` rounds
        that timed both — the paired test (:meth:`_paired_wins`). A rule that beat dense
        decisively when dense retired from the rounds has won for good: dense runs no more
        steps to pair its later ones with, so a load burst on those must not undo the win (at
        10 Gb/s one lifted sign's allgather, 1.37x dense over 17 steps, above dense's fastest
        early step)."""
        return self._win_reason(rule) is not None

    def _win_reason(self, rule: str) -> str | None:
        """Why ``rule`` wins against dense (which test), or None when it does not."""
        why = self._test_reason(rule)
        if why is None and rule in self._beat_dense:
            return "beat dense decisively in every step before dense retired from the rounds"
        return why

    def _test_reason(self, rule: str) -> str | None:
        """The test by which ``rule``'s samples beat dense's now, or None."""
        s, dense = self._samples[rule], self._samples[DENSE]
        d = statistics.median(dense)
        if not statistics.median(s) < min(d * (1 - self.prefer_dense), d - MIN_GAIN_S):
            return None
        if min(len(s), len(dense)) >= RANK_MIN_SAMPLES:
            share = faster_pairs(s, dense)
            if share >= RANK_WIN:
                return f"rank test: faster in {share:.0%} of step pairs with dense (>= {RANK_WIN:.0%})"
        if self._paired_wins(rule):
            x = self._paired_log_ratios(rule)
            return (f"paired by round: mean step ratio {math.exp(statistics.fmean(x)):.3f} of dense "
                    f"over {len(x)} rounds, {PAIRED_T:g}+ standard errors below 1")
        if not max(s) < min(dense):
            return None
        if len(s) < 2 or len(dense) < 2 \
                or statistics.fmean(dense) - statistics.fmean(s) > 3 * stderr(s, dense):
            return "every step faster than every dense step, beyond 3 standard errors"
        return None

    def _paired_wins(self, rule: str) -> bool:
        """Over the rounds that timed both ``rule`` and dense (at least
        :data:`PAIRED_MIN_ROUNDS`), the per-round ``log(mean rule step / mean dense step)``
        has its mean below ``log(1 - prefer_dense)`` and :data:`PAIRED_T` standard errors below
        0. A round's steps are seconds apart: the load that moves both cancels in the ratio
        (slow drifts of a shared machine that make the unpaired spread). At 10 Gb/s, 2 ranks,
        the steps of two interleaved plans correlated by ~0.5 (per-step spread ~10%; paired
        log-ratio spread 8.3% where the unpaired difference had 12.7%), so the paired test
        tells a 10% faster plan in 40 steps where the unpaired ones often cannot."""
        x = self._paired_log_ratios(rule)
        if len(x) < PAIRED_MIN_ROUNDS:
            return False
        mean = statistics.fmean(x)
        return mean < math.log(1 - self.prefer_dense) and -mean > PAIRED_T * self._paired_sd(x) / math.sqrt(len(x))

    def _paired_sd(self, x: list[float]) -> float:
        """The spread of one rule's per-round log-ratios ``x``: at least the one pooled over
        the compressed rules still in play that were timed in two rounds or more (each about
        its own mean: the rules' gains differ, their round-to-round noise is the machine's).
        From 4 rounds one rule's spread has 3 degrees of freedom and comes out at half the true
        one in 1 tuning of 10 (with its own spread, 3 standard errors locked an equal plan in
        22 of 400 simulated tunings): the pooled one, over 3 rules, guards the test against
        that without letting a quiet rule lower a noisy one's. Dropped rules leave the pool: a
        plan 30% slower with stalls (top-k's two_phase at 10 Gb/s) has a spread of its own that
        must not hide a clear winner."""
        own = statistics.stdev(x)
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
            return gap < 3 * stderr(a, b)

        ties = [r for r in winners if tied(r)]
        if len(ties) == 1:
            return fastest, ties
        key = self.preference if self.preference is not None else self.trials.index
        return min(ties, key=lambda r: (key(r), self.trials.index(r))), ties
