"""What the autotuner prints: the trial table of ``state.plan`` and the one line logged at
INFO when ``auto`` locks a plan."""

from __future__ import annotations

import math

__all__ = ["format_tuner", "lock_summary"]


def format_tuner(t) -> str:
    """The trial table (rule, median step, steps counted, dense's median over it) and the
    decision, or the phase in progress."""
    if not t.table:
        state = (f"trial phase from step {t.start}: {t.trials}" if t.start is not None
                 else "not started")
        return f"autotune: {state}" + (f", locked {t.decision!r}" if t.locked else "")
    dense = t.table[0][1]
    lines = [f"{'trial':>16} {'step ms':>10} {'steps':>6} {'vs dense':>9}"]
    for rule, s, n in t.table:
        rel = f"{dense / s:>8.2f}x" if math.isfinite(s) and math.isfinite(dense) and s > 0 else f"{'-':>9}"
        lines.append(f"{rule:>16} {s * 1e3:>10.1f} {n:>6} {rel}"
                     + ("   <- locked" if rule == t.decision else ""))
    lines.append(f"autotune: locked {t.decision!r} after {t.tuning_steps} tuning steps "
                 f"(cost {t.tuning_cost_s * 1e3:.0f} ms beyond the locked plan; a compressed "
                 f"plan must beat every dense step and the dense median by "
                 f"{t.prefer_dense:.0%}); tunings so far: {t.tunings}")
    return "\n".join(lines)


def lock_summary(t) -> str:
    """One line: what ``t`` locked, its median step against dense's, why (the rule that
    decided), and what the tuning cost in steps and time."""
    med = {r: s for r, s, _ in t.table}
    mine, dense = med.get(t.decision, math.nan), med.get("dense", math.nan)
    ratio = (f"{dense / mine:.2f}x dense's median step" if math.isfinite(mine)
             and math.isfinite(dense) and mine > 0 else "no measured ratio to dense")
    return (f"autotune locked {t.decision!r} ({ratio}; {t.reason}); tuning took "
            f"{t.tuning_steps} steps, {t.tuning_cost_s * 1e3:.0f} ms beyond the locked plan")
