"""Replay measured step times through the autotuner's decision rules (no training, no links).

How often does ``algorithm="auto"`` lock a plan that is X% faster than dense, and how often
one that is not faster at all, under the step-to-step noise of a real run? This bench answers
it from measured steps instead of a noise model: ``bench/ddp_step.py --interleave 2 --json``
times dense and compressed hooks in alternating blocks of 2 steps (the autotuner's trial
rounds: dense, A, B, ... with the first step of each not counted), keeping every counted
step's time (``times_ms``). Each replayed tuning runs :class:`comms.autotune.Autotuner` on a
synthetic clock; each of its rounds draws one measured block at random and gives every rule
its step of that block — steps taken seconds apart, so a load that moved the whole block
moves them all, as in a live tuning. A rule's times are the measured hook's, scaled so that
its mean is ``(1 - gain)`` times dense's mean (the measured ratio divided out): the same
noise, the gain chosen.

Rules: ``a`` (the first compressed hook, gain from ``--gains``) and, with ``--rules 2`` or 3,
``b`` (the second hook, gain ``--other-gain``, default -0.3: a plan 30% slower, as two_phase
is at 10 Gb/s) and ``c`` (the second hook again, as fast as dense). Printed per gain: the
tunings that locked each rule, with and without the paired test (``PAIRED_T`` set to
infinity), and the mean tuning steps; then the same rules under independent +-20% uniform
noise, where nothing is paired.

Example::

    python bench/ddp_step.py -n 2 --netsim 10gbit --hooks dense,qsgd4@allgather,sign+ef@allgather \\
        --interleave 2 --steps 60 --no-floor --no-codec --json bench/results/step_times_10gbit_s17.json
    python bench/autotune_replay.py bench/results/step_times_10gbit_s17.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comms import autotune  # noqa: E402
from comms.autotune import DENSE, Autotuner  # noqa: E402

__all__ = ["load_blocks", "replay", "main"]


def load_blocks(path: str) -> tuple[list[str], list[list[float]]]:
    """``(hooks, blocks)`` from a ``ddp_step.py --interleave 2 --json`` file: ``blocks[k]`` is
    every hook's k-th counted step (ms), dense first. Raises if dense or per-step times are
    missing, or if fewer than two hooks were timed."""
    rows = [r for r in json.loads(Path(path).read_text())["rows"] if r.get("times_ms")]
    dense = next((r for r in rows if r["hook"] == "dense"), None)
    if dense is None or len(rows) < 2:
        raise ValueError(f"{path}: needs per-step times (times_ms) of dense and at least one "
                         f"compressed hook, found {[r['hook'] for r in rows]}")
    rows = [dense] + [r for r in rows if r is not dense and r["hook"] != "floor"]
    n = min(len(r["times_ms"]) for r in rows)
    return [r["hook"] for r in rows], [[r["times_ms"][k] for r in rows] for k in range(n)]


@contextlib.contextmanager
def _paired(on: bool):
    saved = autotune.PAIRED_T
    autotune.PAIRED_T = saved if on else math.inf
    try:
        yield
    finally:
        autotune.PAIRED_T = saved


def _tune(step_time, rules: list[str], seed: int) -> tuple[str, int]:
    """One tuning on a synthetic clock; ``step_time(rule, round, rng)`` in seconds."""
    rng = random.Random(seed)
    tuner = Autotuner(steps_per_trial=2, trials=len(rules), candidates=rules)
    clock = 0.0
    for step in range(200):
        rule = tuner.begin_step(step, clock, lambda: rules, lambda v: v)
        if tuner.locked:
            return tuner.decision, tuner.tuning_steps
        clock += step_time(rule, tuner._rounds, rng)  # the round this step belongs to
    raise RuntimeError("the tuner never locked within 200 steps")


def replay(blocks: list[list[float]], gains: dict[str, float], tunings: int, paired: bool,
           measured: bool = True) -> tuple[Counter, float]:
    """Locks per rule over ``tunings`` seeded tunings, and the mean tuning steps.

    ``gains``: rule -> (hook column in ``blocks``, gain vs dense). ``measured=False``: every
    step independent, ``1 +- 20%`` uniform times ``1 - gain`` (nothing to pair)."""
    dense_mean = statistics.fmean(b[0] for b in blocks)
    scale = {}
    for rule, (col, gain) in gains.items():
        scale[rule] = (col, dense_mean * (1 - gain) / statistics.fmean(b[col] for b in blocks))
    scale[DENSE] = (0, 1.0)
    drawn: dict[int, int] = {}

    def step_time(rule, rnd, rng):
        if not measured:
            g = 0.0 if rule == DENSE else gains[rule][1]
            return (1 - g) * (1 + rng.uniform(-0.2, 0.2))
        if rnd not in drawn:
            drawn[rnd] = rng.randrange(len(blocks))
        col, f = scale[rule]
        return blocks[drawn[rnd]][col] * f / 1e3

    locks, steps = Counter(), []
    with _paired(paired):
        for seed in range(tunings):
            drawn.clear()
            decision, n = _tune(step_time, list(gains), seed)
            locks[decision] += 1
            steps.append(n)
    return locks, statistics.fmean(steps)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="bench/ddp_step.py --interleave 2 --json output")
    p.add_argument("--gains", default="-0.03,0,0.067,0.10,0.12,0.15",
                   help="gains of rule a vs dense (fraction of dense's mean step)")
    p.add_argument("--rules", type=int, default=2, choices=(1, 2, 3), help="compressed rules in play")
    p.add_argument("--other-gain", type=float, default=-0.3, help="rule b's gain (-0.3: 30%% slower)")
    p.add_argument("--tunings", type=int, default=400)
    args = p.parse_args(argv)
    hooks, blocks = load_blocks(args.json)
    other = 2 if len(hooks) > 2 else 1
    print(f"# {args.json}: {len(blocks)} blocks of {hooks}; rule a = {hooks[1]}, "
          f"b = {hooks[other]} at gain {args.other_gain}, c = {hooks[other]} as fast as dense; "
          f"{args.rules} rule(s) in play, {args.tunings} tunings each")
    d = [b[0] for b in blocks]
    for col in range(1, len(hooks)):
        x = [b[col] for b in blocks]
        lr = [math.log(a / b) for a, b in zip(x, d)]
        print(f"# {hooks[col]}: mean {statistics.fmean(x):.1f} ms vs dense {statistics.fmean(d):.1f} "
              f"(spread {statistics.stdev(x) / statistics.fmean(x):.1%} vs {statistics.stdev(d) / statistics.fmean(d):.1%}), "
              f"correlation with dense {statistics.correlation(x, d):.2f}, paired log-ratio spread "
              f"{statistics.stdev(lr):.3f}")
    print(f"{'noise':>9} {'gain a':>7} {'paired test':>12} {'locked a':>9} {'locked b/c':>11} {'dense':>6} {'steps':>6}")
    for measured in (True, False):
        for gain in (float(g) for g in args.gains.split(",")):
            rules = {"a": (1, gain), "b": (other, args.other_gain), "c": (other, 0.0)}
            rules = dict(list(rules.items())[: args.rules])
            for paired in (False, True):
                locks, steps = replay(blocks, rules, args.tunings, paired, measured)
                print(f"{'measured' if measured else 'uniform':>9} {gain:>7.3f} {'on' if paired else 'off':>12} "
                      f"{locks['a']:>9} {locks['b'] + locks['c']:>11} {locks[DENSE]:>6} {steps:>6.1f}")


if __name__ == "__main__":
    main()
