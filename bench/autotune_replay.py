"""Replay measured step times through the autotuner's decision rules (no training, no links).

How often does ``algorithm="auto"`` lock a plan that is X% faster than dense, and how often
one that is not faster at all, under the step-to-step noise of a real run? This bench answers
it from measured steps instead of a noise model: ``bench/ddp_step.py --interleave 2 --json``
times dense and compressed hooks in alternating blocks of 2 steps (the autotuner's trial
rounds: dense, A, B, ... with the first step of each not counted), keeping every counted
step's time (``times_ms``). Each replayed tuning runs :class:`comms.tuning.autotune.Autotuner` on a
synthetic clock; each of its rounds draws one measured block ``k`` at random and gives every
rule its step of that block (and of block ``k + 1`` to a rule's second step in the round) —
steps taken seconds apart, so a load that moved the whole block moves them all, as in a live
tuning. A rule's times are the measured hook's, scaled so that
its mean is ``(1 - gain)`` times dense's mean (the measured ratio divided out): the same
noise, the gain chosen.

Rules: ``a`` (the first compressed hook, gain from ``--gains``) and, with ``--rules 2`` or 3,
``b`` (the second hook, gain ``--other-gain``, default -0.3: a plan 30% slower, as two_phase
is at 10 Gb/s) and ``c`` (the second hook again, gain ``--third-gain``, default 0: as fast as
dense). Printed per gain: the tunings that locked each rule, and the mean tuning steps; then
the same under independent +-20% uniform noise, where nothing is paired.

``--phases`` replays logged tunings instead: every ``autotune phase steps:`` line (the
autotuner logs the agreed trial steps of each phase at DEBUG; ``bench/autotune.py`` keeps them
in its report) is run through the rules again, and the decision is printed per tuning.

Example::

    python bench/ddp_step.py -n 2 --netsim 10gbit --hooks dense,qsgd4@allgather,sign+ef@allgather \\
        --interleave 2 --steps 60 --no-floor --no-codec --json /tmp/step_times_10gbit.json
    python bench/autotune_replay.py /tmp/step_times_10gbit.json
    # every measured tuning in the autotune reports under bench/results
    python bench/autotune_replay.py --phases $(grep -l "autotune phase steps" bench/results/*.md)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import Counter, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from comms.tuning.autotune import DENSE, Autotuner  # noqa: E402

__all__ = ["load_blocks", "load_phases", "replay", "replay_phase", "main"]


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


def _tune(step_time, rules: list[str], seed: int) -> tuple[str, int]:
    """One tuning on a synthetic clock; ``step_time(rule, round, position, rng)`` in seconds
    (``position``: the step's index in its rule's block of the round)."""
    rng = random.Random(seed)
    tuner = Autotuner(steps_per_trial=2, trials=len(rules), candidates=rules)
    clock = 0.0
    for step in range(200):
        rule = tuner.begin_step(step, clock, lambda: rules, lambda v: v)
        if tuner.locked:
            return tuner.decision, tuner.tuning_steps
        first = next(s for s, r, _ in tuner._round if r == rule)
        clock += step_time(rule, tuner._rounds, step - first, rng)  # the round this step belongs to
    raise RuntimeError("the tuner never locked within 200 steps")


def replay(blocks: list[list[float]], gains: dict[str, float], tunings: int,
           measured: bool = True) -> tuple[Counter, float]:
    """Locks per rule over ``tunings`` seeded tunings, and the mean tuning steps.

    ``gains``: rule -> (hook column in ``blocks``, gain vs dense). ``measured=False``: every step independent, ``1 +- 20%`` uniform times
    ``1 - gain`` (nothing to pair). A round draws a measured block ``k`` at random; the
    ``j``-th step of a rule's block in that round takes the rule's time of block ``k + j``
    (the next block was measured seconds later: a round's steps share its load, not one
    value)."""
    dense_mean = statistics.fmean(b[0] for b in blocks)
    scale = {}
    for rule, (col, gain) in gains.items():
        scale[rule] = (col, dense_mean * (1 - gain) / statistics.fmean(b[col] for b in blocks))
    scale[DENSE] = (0, 1.0)
    drawn: dict[int, int] = {}

    def step_time(rule, rnd, pos, rng):
        if not measured:
            g = 0.0 if rule == DENSE else gains[rule][1]
            return (1 - g) * (1 + rng.uniform(-0.2, 0.2))
        if rnd not in drawn:
            drawn[rnd] = rng.randrange(len(blocks))
        col, f = scale[rule]
        return blocks[(drawn[rnd] + pos) % len(blocks)][col] * f / 1e3

    locks, steps = Counter(), []
    for seed in range(tunings):
        drawn.clear()
        decision, n = _tune(step_time, list(gains), seed)
        locks[decision] += 1
        steps.append(n)
    return locks, statistics.fmean(steps)


def load_phases(path: str) -> list[list[tuple[str, float]]]:
    """Every ``autotune phase steps: rule:ms ...`` line of a log or results file (the
    autotuner logs one per trial phase at DEBUG; bench/autotune.py keeps them): the agreed
    ``(rule, seconds)`` trial steps of each tuning, in order."""
    out = []
    for line in Path(path).read_text().splitlines():
        if "autotune phase steps:" in line:
            items = line.split("autotune phase steps:", 1)[1].split()
            out.append([(r, float(ms) / 1e3) for r, ms in (it.rsplit(":", 1) for it in items)])
    if not out:
        raise ValueError(f"{path}: no 'autotune phase steps:' lines")
    return out


def replay_phase(steps: list[tuple[str, float]]) -> str:
    """The decision of one measured tuning under the autotuner's rules: each rule's measured steps
    are handed out in their order as the replayed tuner asks for that rule. ``"?"`` when the
    replay asks a rule for more steps than were measured (the rules kept it longer)."""
    queues: dict[str, deque] = {}
    for r, v in steps:
        queues.setdefault(r, deque()).append(v)
    rules = [r for r in queues if r != DENSE]
    tuner = Autotuner(steps_per_trial=2, trials=len(rules), candidates=rules)
    clock = 0.0
    for step in range(len(steps) + 1):
        rule = tuner.begin_step(step, clock, lambda: rules, lambda v: v)
        if tuner.locked:
            return tuner.decision
        if not queues[rule]:
            return "?"
        clock += queues[rule].popleft()
    return "?"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="bench/ddp_step.py --interleave 2 --json output (with "
                   "--phases: one or more logs or results files)")
    p.add_argument("--gains", default="-0.03,0,0.067,0.10,0.12,0.15",
                   help="gains of rule a vs dense (fraction of dense's mean step)")
    p.add_argument("--rules", type=int, default=2, choices=(1, 2, 3), help="compressed rules in play")
    p.add_argument("--other-gain", type=float, default=-0.3, help="rule b's gain (-0.3: 30%% slower)")
    p.add_argument("--third-gain", type=float, default=0.0, help="rule c's gain (0: as fast as dense)")
    p.add_argument("--tunings", type=int, default=400)
    p.add_argument("--phases", action="store_true",
                   help="json are logs or results files with 'autotune phase steps:' lines: replay "
                        "each measured tuning and print its decision")
    args = p.parse_args(argv)
    if args.phases:
        _print_phases(args.json)
        return
    if len(args.json) != 1:
        p.error("one step-times file, or --phases")
    hooks, blocks = load_blocks(args.json[0])
    other = 2 if len(hooks) > 2 else 1
    print(f"# {args.json[0]}: {len(blocks)} blocks of {hooks}; rule a = {hooks[1]}, "
          f"b = {hooks[other]} at gain {args.other_gain}, c = {hooks[other]} at gain {args.third_gain}; "
          f"{args.rules} rule(s) in play, {args.tunings} tunings each")
    d = [b[0] for b in blocks]
    for col in range(1, len(hooks)):
        x = [b[col] for b in blocks]
        lr = [math.log(a / b) for a, b in zip(x, d)]
        print(f"# {hooks[col]}: mean {statistics.fmean(x):.1f} ms vs dense {statistics.fmean(d):.1f} "
              f"(spread {statistics.stdev(x) / statistics.fmean(x):.1%} vs {statistics.stdev(d) / statistics.fmean(d):.1%}), "
              f"correlation with dense {statistics.correlation(x, d):.2f}, paired log-ratio spread "
              f"{statistics.stdev(lr):.3f}")
    print(f"{'noise':>9} {'gain a':>7} {'locked a':>9} {'locked b/c':>11} {'dense':>6} {'steps':>6}")
    for measured in (True, False):
        for gain in (float(g) for g in args.gains.split(",")):
            rules = {"a": (1, gain), "b": (other, args.other_gain), "c": (other, args.third_gain)}
            rules = dict(list(rules.items())[: args.rules])
            locks, steps = replay(blocks, rules, args.tunings, measured)
            print(f"{'measured' if measured else 'uniform':>9} {gain:>7.3f} "
                  f"{locks['a']:>9} {locks['b'] + locks['c']:>11} {locks[DENSE]:>6} {steps:>6.1f}")


def _print_phases(paths: list[str]) -> None:
    """Each logged tuning's decision under the rules, per file, and the totals."""
    got = Counter()
    for path in paths:
        if len(paths) > 1:
            print(f"# {path}")
        print(f"{'tuning':>6} {'steps':>5} {'decision':>12}")
        for k, steps in enumerate(load_phases(path)):
            decision = replay_phase(steps)
            got["unfinished" if decision == "?" else "dense" if decision == DENSE else "compressed"] += 1
            print(f"{k:>6} {len(steps):>5} {decision:>12}")
    print(f"# {sum(got.values())} tunings: {got['compressed']} locked a compressed rule, "
          f"{got['dense']} dense, {got['unfinished']} ran past their logged steps (?)")


if __name__ == "__main__":
    main()
