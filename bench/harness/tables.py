"""How the benches print and write results: aligned text tables, markdown, CSV, progress."""

from __future__ import annotations

import csv
import os
import sys
import time
from typing import Iterable, Sequence

__all__ = ["format_table", "write_csv", "write_text", "progress"]


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def format_table(rows: list[dict], columns: Sequence[str], markdown: bool = False) -> str:
    """Right-aligned text table (or a markdown table) of ``rows`` in ``columns`` order;
    the first column is left-aligned, missing values print as ``-``."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    if markdown:
        out = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if i else "---" for i in
                                                                 range(len(columns))) + "|"]
        out += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(out)
    width = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    out = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(columns, width)))]
    out += ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, width)))
            for row in cells]
    return "\n".join(out)


def write_csv(path: str, rows: list[dict], columns: Sequence[str]) -> None:
    """``rows`` as CSV with ``columns`` as the header (other keys are left out)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c) for c in columns})


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def progress(iterable: Iterable, total: int | None = None, desc: str = "", enable: bool = True):
    """tqdm on stderr when installed, else one line per item on stderr (stdout stays the table)."""
    if not enable:
        return iterable
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        return _fallback_progress(iterable, total, desc)


def _fallback_progress(iterable, total, desc):
    t0 = time.monotonic()
    for i, item in enumerate(iterable):
        print(f"# {desc} {i + 1}/{total or '?'} ({time.monotonic() - t0:.0f}s)", file=sys.stderr,
              flush=True)
        yield item
