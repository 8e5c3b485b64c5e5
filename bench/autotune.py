"""Autotune bench: DDP step time of ``algorithm="auto"`` against dense allreduce and every
fixed (flat) algorithm of the same compressor, in one run, as ratios.

Each round registers every configuration afresh (auto tunes again: one tuning per round).
By default a round's configurations are measured interleaved (``--interleave B``: all built and
warmed up, then blocks of B steps in turn), so that the ratios of one tuning compare steps
taken seconds apart; ``--interleave 0`` measures them one after another as earlier runs did.

For each compressor spec: ``dense`` (DDP's own allreduce), ``auto(<spec>)`` and
``<spec>@<alg>`` for every flat algorithm the compressor supports (the cost model proposes, the
autotuner measures and locks; with ``sync_every=0``: the per-step plan, unless
``--allow-outer``), and torch's own hooks in the same rounds (``--torch-hooks``:
``match``, the default, puts ``fp16_compress_hook`` beside an fp16 spec and ``powerSGD_hook`` of
the same rank beside a PowerSGD spec; ``all`` puts torch-fp16 and torch-psgd-r1 in every group;
``none``). Torch's rows are never a candidate for "the best fixed algorithm". The floors of
the same rounds: ``no-comm floor`` (the same model trained without DDP on every rank at once,
world size 1, in the round's interleaved blocks; ``--no-floor`` drops it) and each row's
``raw_ms`` (one plain gloo allreduce sending the row's wire bytes, the last round's).
``--control ALG`` adds a second, identical ``<spec>@ALG`` row (``--control dense``: of
dense) named ``... (copy)``, never a candidate either: its per-round ratio to the first copy
(``copy_vs_pin``) is what the same plan measures against itself in one round, the noise floor
under every per-tuning ratio. With ``optimizer=`` (``--pairing optimizer``, the default) auto
weighs a compressed plan by its steps to dense's loss as well as its step
(:mod:`comms.tuning.quality_cost`): the verdict compares it with the fixed choice — dense or a
pin — fastest counted the same way (``vs_best_to_quality``), the step-time ratio beside it
(``vs_best_fixed``). Each group's verdict line also pools its rounds: the geometric
mean of the per-round ratios with +-2 standard errors (:func:`pooled_ratio`), a systematic gap
that no single round can resolve.
Step times: the median of ``--steps`` counted steps after a warm-up (``--warmup`` steps for
auto, at least ``start_iter + 2``, and auto then runs on until its tuner locked, so what is
measured is its steady state; ``--fixed-warmup`` steps for the other rows; max over ranks), taken ``--rounds`` times per group in ABBA order (the machine is
shared: its load drifts); the median of the rounds is reported.
The autotuner's trial table (rank 0, from its log) is printed after the step table.

    python bench/autotune.py -n 2 --netsim 10gbit --specs fp16,powersgd:rank=1
    python bench/autotune.py -n 2 --specs fp16 --steps 4            # unshaped, quick

Example::

    >>> rows = rank_main(rank, world, args)   # list of row dicts on rank 0
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import statistics
import sys

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # for harness; last, so that
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # bench/*.py never shadow packages
import harness  # noqa: E402  (puts the repository root first on sys.path)
from harness import hooks, launching, machine, tables  # noqa: E402
import ddp_step  # noqa: E402

__all__ = ["configs_for", "rank_main", "main"]

logger = logging.getLogger(__name__)

COLUMNS = ["group", "hook", "algorithm", "buckets", "step_ms", "p90_ms", "speedup", "vs_best_fixed", "wire_MB",
           "raw_ms", "rounds_ms"]
TUNING_COLUMNS = ["group", "round", "locked", "tuned", "retuned", "auto_ms", "dense_ms", "best_fixed",
                  "best_fixed_ms", "vs_dense", "vs_best_fixed", "best_to_quality", "vs_best_to_quality",
                  "torch_hook", "vs_torch", "copy_vs_pin"]
COPY = " (copy)"  # --control: the name suffix of the identical second row
TORCH_HOOKS = ("match", "all", "none")
# the tuner's targets for every tuning in steady state, and the decision's consistency
MIN_VS_BEST_FIXED, MIN_VS_DENSE, MIN_SAME_DECISION = 0.95, 0.97, 0.8


def tuning_rows(spec_label: str, times: dict, autos: list, fixed: list, torch_rows: tuple = (),
                copies: tuple = (), steps: float = 1.0) -> list[dict]:
    """One row per tuning (= per round): what auto locked and its steady-state step against
    dense, the best fixed compressed algorithm and torch's hook (the first of ``torch_rows``,
    if any), all measured in the SAME round. The best fixed algorithm is the one with the
    lowest median over all rounds (the minimum of several noisy fixed rows within one round
    would be biased low). ``copies`` (``--control``): the name of an identical second row of a
    fixed plan; ``copy_vs_pin`` is the first row's step over the copy's, the same round.

    ``steps``: the compressor's steps to dense's loss per dense step, as auto counts them
    (:func:`comms.tuning.quality_cost.steps_for_dense_loss`; 1 without ``optimizer=``).
    Counted to quality, a compressed step costs ``steps`` times its time: ``best_to_quality``
    is the fixed choice — dense or a compressed pin — fastest to dense's loss by that count,
    and ``vs_best_to_quality`` its counted step over auto's (auto's counted the same way)."""
    out = []
    auto_name = next(n for n in times if n.startswith("auto("))
    th = torch_rows[0] if torch_rows else None
    best = min(fixed, key=lambda n: statistics.median(times[n])) if fixed else None
    counted = {"dense": 1.0, **{n: steps for n in fixed}}
    best_q = min(counted, key=lambda n: counted[n] * statistics.median(times[n]))
    copy = copies[0] if copies else None
    for rnd, row in enumerate(autos):
        a, d = times[auto_name][rnd], times["dense"][rnd]
        b = times[best][rnd] if best else float("nan")
        a_q = a * (1.0 if row["algorithm"] in ("dense", "auto:dense") else steps)
        out.append({"group": spec_label, "round": rnd, "locked": row["algorithm"], "tuned": row.get("tuned", ""),
                    "retuned": "yes" if row.get("retuned") else "-",
                    "auto_ms": a, "dense_ms": d, "best_fixed": best or "-", "best_fixed_ms": b,
                    "vs_dense": d / a, "vs_best_fixed": b / a, "best_to_quality": best_q,
                    "vs_best_to_quality": counted[best_q] * times[best_q][rnd] / a_q,
                    "torch_hook": th or "-",
                    "vs_torch": times[th][rnd] / a if th else float("nan"),
                    "copy_vs_pin": (times[copy[: -len(COPY)]][rnd] / times[copy][rnd]) if copy else float("nan")})
    return out


def steps_to_quality(spec: str, args) -> float:
    """What auto counts per step of ``spec`` (the bench's SGD): its steps to dense's loss
    with ``optimizer=`` (``--pairing optimizer``, the default), else 1."""
    from compressors import from_spec
    from comms.tuning.quality_cost import steps_for_dense_loss

    if getattr(args, "pairing", "optimizer") != "optimizer":
        return 1.0
    return steps_for_dense_loss(from_spec(spec))


def tuning_verdict(rows: list[dict]) -> str:
    """Against the tuner's targets: every tuning >= 0.95x the best fixed choice counted to
    quality (``vs_best_to_quality``; the step-time ratio beside it) and >= 0.97x dense; the
    same decision in >= 80% of the tunings."""
    from collections import Counter

    decisions = Counter(r["locked"] for r in rows)
    top, n = decisions.most_common(1)[0]
    worst_fixed = min(r["vs_best_fixed"] for r in rows)
    worst_quality = min(r["vs_best_to_quality"] for r in rows)
    worst_dense = min(r["vs_dense"] for r in rows)
    ok = lambda c: "met" if c else "MISSED"  # noqa: E731
    copies = [r["copy_vs_pin"] for r in rows if r.get("copy_vs_pin") == r.get("copy_vs_pin")]  # not nan
    control = (f"; an identical plan against itself, per round: {min(copies):.3f}-{max(copies):.3f}x"
               if copies else "")
    pooled = "; pooled over the rounds: " + ", ".join(
        f"{what} {pooled_ratio(vals)}" for what, vals in (
            ("vs dense", [r["vs_dense"] for r in rows]),
            ("vs the best fixed", [r["vs_best_fixed"] for r in rows]),
            ("copy vs pin", copies)) if len(vals) > 1 and all(v == v for v in vals))
    return (f"{rows[0]['group']}: locked {dict(decisions)} — same decision {n}/{len(rows)} "
            f"({ok(n >= MIN_SAME_DECISION * len(rows))}); worst tuning {worst_quality:.3f}x the best fixed "
            f"counted to quality, {rows[0]['best_to_quality']} ({ok(worst_quality >= MIN_VS_BEST_FIXED)}), "
            f"{worst_fixed:.3f}x the best fixed step, {worst_dense:.3f}x dense ({ok(worst_dense >= MIN_VS_DENSE)})"
            + control + pooled)


def pooled_ratio(ratios: list) -> str:
    """The geometric mean of per-round ratios with its +-2 standard errors (of the mean of the
    logs), e.g. ``"1.021x (2 SE 0.990-1.053)"``: a systematic difference that no single
    round of a noisy machine can show. Needs two or more ratios."""
    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(logs))
    return f"{math.exp(m):.3f}x (2 SE {math.exp(m - 2 * se):.3f}-{math.exp(m + 2 * se):.3f})"


def torch_configs(comp, torch_hooks: str = "match") -> list:
    """Torch's own hooks for a group (``--torch-hooks``): ``match`` gives torch's counterpart
    of the compressor (``fp16_compress_hook`` for fp16, ``powerSGD_hook`` at the same rank for
    PowerSGD, none for the others), ``all`` torch-fp16 and torch-psgd-r1, ``none`` nothing."""
    if torch_hooks == "all":
        return [hooks.torch_hook("fp16"), hooks.torch_hook("powersgd", 1)]
    if torch_hooks == "match" and comp.name in ("fp16", "powersgd"):
        return [hooks.torch_hook(comp.name, getattr(comp, "rank", 0))]
    return []


def configs_for(specs, torch_hooks: str = "match", floor: bool = False, control: str | None = None) -> list:
    """Per spec: dense, ``auto``, every supported flat algorithm, torch's hooks
    (:func:`torch_configs`), with ``floor`` the no-communication floor (kind ``"floor"``) and
    with ``control`` (an algorithm name, or ``"dense"``) a second identical row of
    ``<spec>@<control>`` (or of dense) named ``... (copy)``, last in the group — each group measured back to back, so a change of load on
    the shared machine between groups does not skew a ratio."""
    import comms
    import compressors

    out = []
    for spec in specs:
        comp = compressors.from_spec(spec)
        short = hooks.short_label(spec, None)
        out.append((spec, hooks.HookConfig("dense", "dense")))
        out.append((spec, hooks.HookConfig(f"auto({short})", "ours", spec, "auto", None)))
        out += [(spec, c) for c in torch_configs(comp, torch_hooks)]
        if floor:
            out.append((spec, hooks.HookConfig(ddp_step.FLOOR, "floor")))
        for name, alg in comms.ALGORITHMS.items():
            if getattr(alg, "hierarchical", False) or not comp.supports(alg.family):
                continue
            out.append((spec, hooks.HookConfig(f"{short}@{name}", "ours", spec, name, None)))
        target = "dense" if control == "dense" else f"{short}@{control}"
        pinned = [c for s, c in out if s == spec and c.name == target]
        if control is not None and pinned:
            out.append((spec, dataclasses.replace(pinned[0], name=target + COPY)))
    return out


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "autotune" in msg or "refined" in msg:
            self.records.append(msg)

    @classmethod
    def install(cls) -> "_Capture":
        """A capture of the planner's lock line and trial table, the cost model's refinement
        and the autotuner's trial steps (what ``--phases`` replays)."""
        cap = cls()
        for name, level in (("comms.tuning.planner", logging.DEBUG), ("comms.tuning.cost_model", logging.INFO),
                            ("comms.tuning.autotune", logging.DEBUG)):
            lg = logging.getLogger(name)
            lg.setLevel(level)
            lg.addHandler(cap)
        return cap


def _print_row(spec: str, rnd: int, cfg, row: dict) -> None:
    locked = f" (locked {row['algorithm']} after {row.get('tuned')} steps" \
        f"{'; RETUNED while measured' if row.get('retuned') else ''})" \
        if cfg.algorithm == "auto" else ""
    print(f"#   [{hooks.short_label(spec, None)}] round {rnd} {cfg.name}: {row['step_ms']:.1f} ms{locked}",
          flush=True)


def rank_main(rank: int, world: int, args):
    import torch

    specs = [s for s in args.specs.split(";") if s] if ";" in args.specs else args.specs.split(",")
    configs = configs_for(specs, args.torch_hooks, args.floor, args.control)
    ddp_step.set_one_bucket(args)
    cap = _Capture.install()
    numel = sum(p.numel() for p in ddp_step.build_model(args.model, args.width, args.depth).parameters())
    if rank == 0:
        print(f"# autotune bench: model={args.model} params={numel} world={world} batch={args.batch}/rank "
              f"bucket_cap_mb={args.bucket_cap_mb} warmup={args.warmup} steps={args.steps} "
              f"threads/rank={torch.get_num_threads()} link={args.link}", flush=True)
    rows, logs, per_tuning, verdicts = [], {}, [], []
    auto_warmup = args.warmup
    fixed_warmup = args.fixed_warmup if args.fixed_warmup is not None else args.start_iter + 2
    for spec in specs:
        group = [(s, c) for s, c in configs if s == spec]
        times: dict[str, list] = {c.name: [] for _, c in group}
        p90s: dict[str, list] = {c.name: [] for _, c in group}
        last: dict[str, dict] = {}
        autos: list[dict] = []
        for rnd in range(args.rounds):
            cap.records.clear()
            order = group if rnd % 2 == 0 else group[::-1]
            if args.interleave:
                got = _interleaved_round([c for _, c in order], args, rank, world, auto_warmup, fixed_warmup)
            else:
                got = _sequential_round([c for _, c in order], args, rank, world, auto_warmup, fixed_warmup)
            for _, cfg in group:
                row = got[cfg.name]
                times[cfg.name].append(row["step_ms"])
                p90s[cfg.name].append(row["p90_ms"])
                last[cfg.name] = row
                if cfg.algorithm == "auto":
                    autos.append(row)
                    logs.setdefault(cfg.name, []).extend([f"(round {rnd})"] + cap.records)
                if rank == 0:
                    _print_row(spec, rnd, cfg, row)
        fixed = [c.name for _, c in group if c.kind == "ours" and c.algorithm != "auto" and not c.name.endswith(COPY)]
        torch_rows = tuple(c.name for _, c in group if c.kind.startswith("torch"))
        copies = tuple(c.name for _, c in group if c.name.endswith(COPY))
        tr = tuning_rows(hooks.short_label(spec, None), times, autos, fixed, torch_rows, copies,
                         steps_to_quality(spec, args))
        per_tuning += tr
        verdicts.append(tuning_verdict(tr))
        for _, cfg in group:
            row = dict(last[cfg.name], group=hooks.short_label(spec, None))
            row["step_ms"] = statistics.median(times[cfg.name])
            row["p90_ms"] = max(p90s[cfg.name])
            row["rounds_ms"] = "/".join(f"{t:.0f}" for t in times[cfg.name])
            rows.append(row)
        if rank == 0:
            print(verdicts[-1], flush=True)
        _report(rank, world, args, specs, rows, configs, per_tuning, verdicts, logs, partial=True)
    args.warmup = auto_warmup
    return _report(rank, world, args, specs, rows, configs, per_tuning, verdicts, logs)


def _sequential_round(cfgs, args, rank, world, auto_warmup, fixed_warmup) -> dict:
    """One round as rows measured one after another (ABBA across rounds: the caller reverses
    every other round, so a drift of the machine's load during the group cancels out)."""
    out = {}
    for cfg in cfgs:
        args.warmup = auto_warmup if cfg.algorithm == "auto" else fixed_warmup
        out[cfg.name] = ddp_step.measure_floor(args, rank, world) if cfg.kind == "floor" \
            else ddp_step.measure(cfg, args, rank, world)
    return out


def _interleaved_round(cfgs, args, rank, world, auto_warmup, fixed_warmup) -> dict:
    """One round with every configuration's measured steps interleaved: all are built and
    warmed up (auto until its tuner locked), then they take turns in blocks of
    ``args.interleave`` steps (order reversed every other block) until each has
    ``args.steps`` counted steps. The first step of every block is not counted, for every
    configuration alike (it meets caches the others just used). A load change on the shared
    machine then falls on every row of the round instead of on whichever ran during it.

    The autotuner times its steps from one bucket-0 call to the next, so the first step of
    each of auto's blocks looks slow to it (the others' block ran in between); its watchdog
    takes medians, and a retune while measured is reported (``retuned``)."""
    runners = []
    for cfg in cfgs:
        args.warmup = auto_warmup if cfg.algorithm == "auto" else fixed_warmup
        run = ddp_step.FloorRunner(args, rank, world) if cfg.kind == "floor" \
            else ddp_step.StepRunner(cfg, args, rank, world)
        run.warm_up()
        runners.append(run)
    tunings = [r.tunings() for r in runners]
    times = ddp_step.interleaved_times(runners, args.steps, args.interleave)
    out = {}
    for cfg, run, ts, t0 in zip(cfgs, runners, times, tunings):
        row = run.row(ts)
        row["retuned"] = run.tunings() > t0
        out[cfg.name] = row
    for run in runners:
        run.close()
    return out


def _report(rank, world, args, specs, rows, configs, per_tuning, verdicts, logs, partial=False):
    """Ratios per group, the tables and OUT.md (also after each group: a run cut short by its
    timeout keeps what it measured)."""
    for spec in specs:
        group = [(r, c) for r, (s, c) in zip(rows, configs) if s == spec]  # rows follow configs
        if not group:
            continue
        dense = next(r for r, c in group if c.kind == "dense")
        # dense counts as a fixed choice here; torch's hooks do not (they are the comparison),
        # nor the floor (no plan reaches it)
        best = min((r for r, c in group if c.algorithm != "auto" and c.kind in ("dense", "ours")
                    and not c.name.endswith(COPY)), key=lambda r: r["step_ms"])
        for r, c in group:
            r["speedup"] = dense["step_ms"] / r["step_ms"]
            r["vs_best_fixed"] = best["step_ms"] / r["step_ms"]
            if c.algorithm == "auto":
                r["best_fixed"] = best["hook"]
    if rank != 0:
        return None
    if partial:
        if args.out:
            _write_md(args, world, rows, per_tuning, verdicts, logs, partial=True)
        return rows
    table = tables.format_table(rows, COLUMNS)
    print(table, flush=True)
    summary = _summary(rows)
    print("\n".join(summary), flush=True)
    print(tables.format_table(per_tuning, TUNING_COLUMNS), flush=True)
    print("\n".join(verdicts), flush=True)
    print("\n".join(_log_text(logs)), flush=True)
    if args.out:
        _write_md(args, world, rows, per_tuning, verdicts, logs)
    return rows


def _summary(rows) -> list[str]:
    return [f"{r['hook']}: {r['speedup']:.2f}x of dense, {r['vs_best_fixed']:.2f}x of the best fixed "
            f"choice ({r['best_fixed']})" for r in rows if "best_fixed" in r]


def _log_text(logs) -> list[str]:
    text = []
    for name, recs in logs.items():
        text.append(f"## {name}")
        text += recs
    return text


def _write_md(args, world, rows, per_tuning, verdicts, logs, partial=False) -> None:
    md = [f"# Autotune bench: {args.model}, {world} ranks, link {args.link}"
          + (" (PARTIAL: the groups measured so far)" if partial else ""), "", "```", args.command, "```", "",
          f"Machine: {machine.machine_facts()}.", "", tables.format_table(rows, COLUMNS, markdown=True), "",
          *_summary(rows), "",
          "Per tuning (each round registers afresh and tunes again; ratios against dense and the "
          "fixed compressed algorithm with the lowest median over the rounds, both measured in the "
          "same round):", "",
          tables.format_table(per_tuning, TUNING_COLUMNS, markdown=True), "",
          *[f"- {v}" for v in verdicts], "",
          "```", *_log_text(logs), "```", ""]
    tables.write_text(args.out + ".md", "\n".join(md))


def parser() -> argparse.ArgumentParser:
    p = ddp_step.parser()
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--specs", default="fp16,powersgd:rank=1",
                   help="comma-separated compressor specs (use ';' if a spec has commas)")
    p.add_argument("--torch-hooks", default="match", choices=TORCH_HOOKS,
                   help="torch's own hooks in every group's rounds: match (fp16 beside fp16, "
                        "powerSGD_hook of the same rank beside powersgd), all, none")
    p.add_argument("--control", default=None, metavar="ALG",
                   help="add an identical second <spec>@ALG row (or of dense: --control dense) per "
                        "group: the same plan against itself in each round, the noise floor of the "
                        "per-tuning ratios")
    p.add_argument("--fixed-warmup", type=int, default=None, metavar="N",
                   help="warm-up steps of every row but auto's (default start_iter + 2; auto runs "
                        "until its tuner locked: 8-40 steps): N ~ 40 compares plans whose error "
                        "feedback is as far from its start as auto's")
    p.add_argument("--rounds", type=int, default=2,
                   help="measure each group this many times (ABBA order); step_ms is the median")
    # --interleave (from ddp_step): a round's configurations interleaved in blocks of B steps;
    # 0: one after another (the rows of earlier runs)
    # auto warms up until its tuner locked (StepRunner.warm_up): --warmup need not cover tuning
    p.add_argument("--allow-outer", action="store_true",
                   help="let auto move to the outer sync after it locked (the default path); "
                        "without it auto's rows keep compressing every step (sync_every=0): this "
                        "bench judges the per-step plan against the pinned ones, and the move to "
                        "the outer sync is judged by time to quality (bench/convergence.py)")
    p.set_defaults(warmup=6, steps=16, codec=False, interleave=4)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    args.auto_hook_kwargs = {} if args.allow_outer else {"sync_every": 0}
    return launching.launch_recorded(os.path.abspath(__file__), rank_main, args, argv)


if __name__ == "__main__":
    main()
