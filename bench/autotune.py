"""Autotune bench: DDP step time of ``algorithm="auto"`` against dense allreduce and every
fixed (flat) algorithm of the same compressor, in one run, as ratios.

For each compressor spec: ``dense`` (DDP's own allreduce, once), ``<spec>@<alg>`` for every
flat algorithm the compressor supports, and ``auto(<spec>)`` (the cost model proposes, the
autotuner measures and locks). Step times come from :func:`ddp_step.measure` (median of
``--steps`` after a warm-up long enough to cover the autotune trial phase; max over ranks).
The autotuner's trial table (rank 0, from its log) is printed after the step table.

    python bench/autotune.py -n 2 --netsim 10gbit --specs fp16,powersgd:rank=1
    python bench/autotune.py -n 2 --specs fp16 --steps 4            # unshaped, quick

Example::

    >>> rows = rank_main(rank, world, args)   # list of row dicts on rank 0
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402  (puts the repository root on sys.path)
import ddp_step  # noqa: E402

# ddp_step put bench/ first again; the repository root must win (bench/compressors.py is a
# script, not the package)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["configs_for", "rank_main", "main"]

logger = logging.getLogger(__name__)

COLUMNS = ["hook", "algorithm", "buckets", "step_ms", "p90_ms", "speedup", "vs_best_fixed", "wire_MB"]


def configs_for(specs) -> list:
    """dense, then per spec every supported flat algorithm and ``auto``."""
    import comms
    import compressors

    out = [_common.HookConfig("dense", "dense")]
    for spec in specs:
        comp = compressors.from_spec(spec)
        short = _common._short(spec, None)
        for name, alg in comms.ALGORITHMS.items():
            if getattr(alg, "hierarchical", False) or not comp.supports(alg.family):
                continue
            out.append(_common.HookConfig(f"{short}@{name}", "ours", spec, name, None))
        out.append(_common.HookConfig(f"auto({short})", "ours", spec, "auto", None))
    return out


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "autotune" in msg or "refined" in msg:
            self.records.append(msg)


def rank_main(rank: int, world: int, args):
    import torch

    specs = [s for s in args.specs.split(";") if s] if ";" in args.specs else args.specs.split(",")
    configs = configs_for(specs)
    model_mb = ddp_step._one_bucket_mb(args)
    args.one_bucket_mb = int(model_mb * 1.1) + 2
    if args.bucket_cap_mb is None:
        args.bucket_cap_mb = args.one_bucket_mb
    cap = _Capture()
    for name in ("comms.planner", "comms.cost_model"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        lg.addHandler(cap)
    numel = sum(p.numel() for p in ddp_step.build_model(args.model, args.width, args.depth).parameters())
    if rank == 0:
        print(f"# autotune bench: model={args.model} params={numel} world={world} batch={args.batch}/rank "
              f"bucket_cap_mb={args.bucket_cap_mb} warmup={args.warmup} steps={args.steps} "
              f"threads/rank={torch.get_num_threads()} link={args.link}", flush=True)
    rows, logs = [], {}
    for cfg in configs:
        cap.records.clear()
        rows.append(ddp_step.measure(cfg, args, rank, world))
        if cfg.algorithm == "auto":
            logs[cfg.name] = list(cap.records)
        if rank == 0:
            print(f"#   {cfg.name}: {rows[-1]['step_ms']:.1f} ms", flush=True)
    dense = next(r for r in rows if r["hook"] == "dense")
    for r in rows:
        r["speedup"] = dense["step_ms"] / r["step_ms"]
    for spec in specs:
        short = _common._short(spec, None)
        mine = [r for r, c in zip(rows, configs) if c.spec == spec]
        fixed = [r for r, c in zip(mine, [c for c in configs if c.spec == spec]) if c.algorithm != "auto"]
        best = min([dense] + fixed, key=lambda r: r["step_ms"])
        for r in mine:
            r["vs_best_fixed"] = best["step_ms"] / r["step_ms"]
            if r["hook"] == f"auto({short})":
                r["best_fixed"] = best["hook"]
    if rank != 0:
        return None
    table = _common.format_table(rows, COLUMNS)
    print(table, flush=True)
    text = []
    for name, recs in logs.items():
        text.append(f"## {name}")
        text += recs
    print("\n".join(text), flush=True)
    if args.out:
        md = [f"# Autotune bench: {args.model}, {world} ranks, link {args.link}", "", "```", args.command, "```", "",
              f"Machine: {_common.machine_facts()}.", "", _common.format_table(rows, COLUMNS, markdown=True), "",
              "```", *text, "```", ""]
        _common.write_text(args.out + ".md", "\n".join(md))
    return rows


def parser() -> argparse.ArgumentParser:
    p = ddp_step.parser()
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--specs", default="fp16,powersgd:rank=1",
                   help="comma-separated compressor specs (use ';' if a spec has commas)")
    p.set_defaults(warmup=16, steps=6, codec=False)
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.command is None:
        args.command = _common.shell_command(argv)
        argv = [*argv, "--command", args.command]
    if args.link is None:
        args.link = args.netsim or "unshaped"
        argv = [*argv, "--link", args.link]
    return _common.launch(os.path.abspath(__file__), rank_main, args, argv)


if __name__ == "__main__":
    main()
