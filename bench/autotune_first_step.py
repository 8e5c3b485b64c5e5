"""Is a trial block's first step slower than the block's other steps? (the autotuner's timing)

The autotuner interleaves rules in rounds (dense, A, B, ...), each for ``steps_per_trial``
steps. Whether the first step of a block — the one right after a switch of plan — can count
as a sample is a measured question: this bench runs one long trial phase of ``algorithm="auto"``
(``--block`` steps per rule, ``--budget`` steps, no early decision, rules ``dense`` and
``--candidates``) on the bench model and reports, per rule and position in the block, the
agreed step times (max over ranks), and per rule the mean of ``log(first step / mean of the
block's other steps)`` over the rounds after the first, with its standard error.

Example::

    python bench/autotune_first_step.py -n 2 --netsim 10gbit --spec qsgd:bits=4
    # writes bench/results/autotune_first_step_10gbit.md
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from pathlib import Path

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402,F401  (puts the repository root first on sys.path)
from harness import hooks, launching, machine  # noqa: E402
import ddp_step  # noqa: E402

__all__ = ["blocks_of", "first_step_table", "rank_main", "main"]


def blocks_of(phase: list[tuple[str, float]], block: int) -> list[tuple[str, list[float]]]:
    """The trial phase's agreed ``(rule, seconds)`` steps cut into ``(rule, block steps)``."""
    out = []
    for i in range(0, len(phase) - block + 1, block):
        rules = {r for r, _ in phase[i:i + block]}
        if len(rules) != 1:
            raise ValueError(f"steps {i}..{i + block - 1} mix rules {sorted(rules)}: not blocks of {block}")
        out.append((phase[i][0], [v for _, v in phase[i:i + block]]))
    return out


def first_step_table(blocks: list[tuple[str, list[float]]]) -> list[str]:
    """Markdown rows: per rule, the median ms per block position (all rounds and the first
    round alone), and ``log(first / rest)`` over the later rounds (mean, standard error)."""
    by: dict[str, list[list[float]]] = {}
    for rule, steps in blocks:
        by.setdefault(rule, []).append(steps)
    width = len(blocks[0][1])
    lines = ["| rule | rounds | " + " | ".join(f"pos {j} median ms" for j in range(width))
             + " | round 1 ms | log(first/rest) later rounds | se |",
             "|---|---:|" + "---:|" * (width + 3)]
    for rule, bl in by.items():
        med = [statistics.median(1e3 * b[j] for b in bl) for j in range(width)]
        x = [math.log(b[0] / statistics.fmean(b[1:])) for b in bl[1:]]
        mean, se = (statistics.fmean(x), statistics.stdev(x) / math.sqrt(len(x))) if len(x) > 1 else (math.nan, math.nan)
        lines.append(f"| {rule} | {len(bl)} | " + " | ".join(f"{m:.1f}" for m in med)
                     + f" | {'/'.join(f'{1e3 * v:.0f}' for v in bl[0])} | {mean:+.3f} | {se:.3f} |")
    return lines


def rank_main(rank: int, world: int, args):
    from comms.tuning.autotune import Autotuner

    ddp_step.set_one_bucket(args)
    cfg = hooks.HookConfig(f"auto({hooks.short_label(args.spec, None)})", "ours", args.spec, "auto", None)
    run = ddp_step.StepRunner(cfg, args, rank, world)
    # one long phase: no early lock, no min_rounds decision before the budget
    tuner = Autotuner(steps_per_trial=args.block, trials=3, candidates=args.candidates.split(","),
                      max_steps=args.budget, min_rounds=10 ** 6, decisive=0.0)
    run.state.planner.tuner = run.tuner = tuner
    steps = 0
    while not tuner.locked and steps < args.budget + 4 * args.block:
        run.step()
        steps += 1
    phase = list(tuner._phase_steps)
    run.close()
    if rank != 0:
        return None
    lines = first_step_table(blocks_of(phase, args.block))
    print("\n".join(lines), flush=True)
    if args.out:
        head = [f"# First step of a trial block: {args.spec}, {world} ranks, link {args.link}",
                "", "```", args.command or "", "```", "", "Machine: " + machine.machine_facts() + ".", "",
                f"Rules dense + {args.candidates}, blocks of {args.block} steps, {args.budget} steps "
                "(one trial phase, no early decision); agreed step times (max over ranks).", ""]
        Path(args.out + ".md").write_text("\n".join(head + lines) + "\n")
    return phase


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = ddp_step.parser()
    p.add_argument("--spec", default="qsgd:bits=4", help="the compressor spec auto tunes")
    p.add_argument("--candidates", default="allgather,two_phase,shared_scale",
                   help="rules tried besides dense")
    p.add_argument("--block", type=int, default=3, help="steps per rule per round")
    p.add_argument("--budget", type=int, default=120, help="steps of the trial phase")
    args = p.parse_args(argv)
    if args.command is None:  # what the user typed, before the default below is made explicit
        args.command = launching.shell_command(argv)
        argv = [*argv, "--command", args.command]
    if args.out is None:  # ddp_step's --out: here OUT.md only
        args.out = os.path.join(harness.RESULTS, f"autotune_first_step_{args.netsim or 'unshaped'}")
        argv = [*argv, "--out", args.out]
    return launching.launch_recorded(os.path.abspath(__file__), rank_main, args, argv)


if __name__ == "__main__":
    main()
