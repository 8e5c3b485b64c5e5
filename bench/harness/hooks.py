"""The hook configurations the DDP benches compare, built from what is installed.

:func:`hook_configs` lists every configuration that the installed ``comms.ALGORITHMS`` and
``compressors.REGISTRY`` can build (and says which it skipped and why), so algorithms and
compressors added later show up without editing the benches.

Example::

    >>> from harness.hooks import hook_configs
    >>> configs, skipped = hook_configs()
    >>> [c.name for c in configs][:3]
    ['dense', 'torch-fp16', 'torch-psgd-r1']
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["HookConfig", "torch_hook", "OURS", "AUTO_SPECS", "DEFAULT_SPECS", "OUTER", "short_label",
           "hook_configs", "filter_configs", "attach_hook", "outer_config"]


@dataclasses.dataclass(frozen=True)
class HookConfig:
    """One way of averaging gradients in DDP.

    Attributes:
        name: short label used in tables and plots.
        kind: ``"dense"`` (DDP's own allreduce, no hook), ``"torch-fp16"``,
            ``"torch-powersgd"`` or ``"ours"`` (a commpress hook).
        spec: compressor spec for ``"ours"``.
        algorithm: aggregation algorithm for ``"ours"`` (``None``: the state's default).
        error_feedback: for ``"ours"``; ``None`` lets the state decide.
        rank: PowerSGD matrix rank for ``"torch-powersgd"``.
        default: ``comms.register(model, spec)`` with every default (``algorithm="auto"``,
            its error-feedback choice): what a user gets out of the box. Benches lead with
            these rows; the others pin an algorithm or a setting and are labelled so.
        sync: the outer sync's ``register`` keywords (``sync_every``, ...) as sorted pairs:
            communicate every H steps (``()``: every step).
    """

    name: str
    kind: str
    spec: str | None = None
    algorithm: str | None = None
    error_feedback: bool | None = None
    rank: int = 0
    default: bool = False
    sync: tuple = ()


# Our compressors in the benches: (spec, error feedback, which algorithms). "each" means every
# registered algorithm whose family the compressor supports; "first" only its preferred one.
# Compressors or algorithms that are not installed are skipped with the reason printed.
OURS = (
    ("topk:density=0.01,exact=false", True, "each"),
    ("qsgd:bits=8", None, "each"),
    ("qsgd:bits=4", None, "each"),
    ("sign", True, "each"),
    ("randomk:density=0.01", True, "first"),
    ("fp16", None, "first"),
    ("powersgd:rank=1", None, "first"),
    ("powersgd:rank=4", None, "first"),
)
# compressors given to the cost-model planner (``algorithm="auto"``): it picks dense
# or a compressed algorithm per bucket, so it should never be much slower than dense
AUTO_SPECS = ("qsgd:bits=8", "powersgd:rank=1", "topk:density=0.01,exact=false")
AUTO_ALGORITHMS = ("auto",)
# the default path: each compressor's spec as a user writes it, nothing else set
DEFAULT_SPECS = ("qsgd:bits=8", "qsgd:bits=4", "topk:density=0.01", "sign", "randomk:density=0.01",
                 "powersgd:rank=1", "fp16")


# the outer sync (communicate every H steps): spec, then register's sync keywords; hand-picked
OUTER = (
    ("qsgd:bits=4", dict(sync_every=4, sync_fragments=2, sync_delay=1)),
    ("qsgd:bits=8", dict(sync_every=4, sync_fragments=2, sync_delay=1)),
    ("sign", dict(sync_every=4, sync_fragments=2, sync_delay=1)),
)


def outer_config(spec: str, sync: dict) -> HookConfig:
    """The outer-sync row of ``spec`` with ``sync`` (named ``outer(qsgd4,H16,P4,tau3)``)."""
    parts = [f"H{sync['sync_every']}"]
    if sync.get("sync_fragments", 1) != 1:
        parts.append(f"P{sync['sync_fragments']}")
    if sync.get("sync_delay"):
        parts.append(f"tau{sync['sync_delay']}")
    if sync.get("outer", "nesterov") != "nesterov":
        parts.append(sync["outer"])
    for key, tag in (("outer_lr", "lr"), ("outer_momentum", "mu")):
        if sync.get(key) is not None:
            parts.append(f"{tag}{sync[key]:g}")
    return HookConfig(f"outer({short_label(spec, None)},{','.join(parts)})", "ours", spec, None, None,
                      sync=tuple(sorted(sync.items())))


def short_label(spec: str, ef: bool | None) -> str:
    """``"topk:density=0.01,exact=false"`` -> ``"topk1%"``; ``"qsgd:bits=4"`` -> ``"qsgd4"``."""
    import compressors

    name, kw = compressors.parse_spec(spec)
    if "density" in kw:
        label = f"{name}{kw['density'] * 100:g}%"
    elif "bits" in kw:
        label = f"{name}{kw['bits']}"
    elif "rank" in kw:
        label = f"{name}-r{kw['rank']}"
    else:
        label = name
    return label + ("+ef" if ef else "")


def _try_state(spec: str, algorithm: str | None, ef: bool | None):
    """Build a CompressionState without a process group; returns (state, None) or (None, why)."""
    import comms

    try:
        return comms.CompressionState(spec, None, algorithm=algorithm, error_feedback=ef), None
    except (ValueError, TypeError, KeyError) as e:
        return None, str(e).splitlines()[0]


def torch_hook(name: str, rank: int = 0) -> HookConfig:
    """Torch's own hook as a configuration: ``"fp16"`` (``fp16_compress_hook``, named
    ``torch-fp16``) or ``"powersgd"`` (``powerSGD_hook`` at ``rank``, ``torch-psgd-r<rank>``)."""
    if name == "fp16":
        return HookConfig("torch-fp16", "torch-fp16")
    if name == "powersgd":
        return HookConfig(f"torch-psgd-r{rank}", "torch-powersgd", rank=rank)
    raise ValueError(f"torch has no {name!r} hook here (fp16 or powersgd)")


def hook_configs(torch_hooks: bool = True, ours: Sequence = OURS,
                 auto: bool = True, auto_specs: Sequence = AUTO_SPECS,
                 defaults: Sequence = DEFAULT_SPECS
                 ) -> tuple[list[HookConfig], list[tuple[str, str]]]:
    """Every hook configuration this installation can run, and what was skipped and why.

    Order: dense, torch's hooks, the default path of every spec in ``defaults`` (named
    ``default(qsgd8)``...), then the pinned configurations (``topk1%+ef@allgather``...).

    Returns:
        ``(configs, skipped)``; ``skipped`` is a list of ``(what, reason)``.
    """
    import comms
    import compressors

    configs = [HookConfig("dense", "dense")]
    skipped: list[tuple[str, str]] = []
    if torch_hooks:
        configs += [torch_hook("fp16"), torch_hook("powersgd", 1), torch_hook("powersgd", 4)]
    for spec in defaults:
        name = compressors.parse_spec(spec)[0]
        st, why = _try_state(spec, "auto", None) if name in compressors.REGISTRY else (None, "not installed")
        if st is None:
            skipped.append((f"default({spec})", why))
            continue
        configs.append(HookConfig(f"default({short_label(spec, None)})", "ours", spec, None, None,
                                  default=True))
    algs = []
    for a, fn in comms.ALGORITHMS.items():
        if a in AUTO_ALGORITHMS:
            continue
        if getattr(fn, "hierarchical", False):  # needs a tiered (multi-node) communicator
            skipped.append((f"* @ {a}", "hierarchical: needs several ranks per node; these benches "
                                        "run one rank per (simulated) host, where it equals the flat form"))
            continue
        algs.append(a)
    for spec, ef, which in ours:
        name = compressors.parse_spec(spec)[0]
        if name not in compressors.REGISTRY:
            skipped.append((spec, f"compressor {name!r} not in compressors.REGISTRY"))
            continue
        if which == "first":
            st, why = _try_state(spec, None, ef)
            if st is None:
                skipped.append((spec, why))
                continue
            configs.append(HookConfig(f"{short_label(spec, st.error_feedback)}@{st.algorithm}", "ours",
                                      spec, st.algorithm, ef))
            continue
        for alg in algs:
            st, why = _try_state(spec, alg, ef)
            if st is None:
                skipped.append((f"{spec} @ {alg}", why))
                continue
            configs.append(HookConfig(f"{short_label(spec, st.error_feedback)}@{alg}", "ours", spec,
                                      alg, ef))
    configs += [outer_config(spec, sync) for spec, sync in OUTER]
    if auto:
        for spec in auto_specs:
            st, why = _try_state(spec, "auto", None)
            if st is None:
                skipped.append((f"auto({spec})", why))
                continue
            configs.append(HookConfig(f"auto({short_label(spec, st.error_feedback)})", "ours", spec,
                                      "auto", None))
    return configs, skipped


def filter_configs(configs: list[HookConfig], patterns: str | None) -> list[HookConfig]:
    """Keep configs whose name contains one of the comma-separated ``patterns``; dense stays."""
    if not patterns:
        return configs
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    keep = [c for c in configs if c.kind == "dense" or any(p == c.name or p in c.name for p in pats)]
    unknown = [p for p in pats if not any(p == c.name or p in c.name for c in configs)]
    if unknown:
        raise ValueError(f"--hooks {unknown} match no configuration; available: "
                         f"{[c.name for c in configs]}")
    return keep


def attach_hook(ddp, cfg: HookConfig, process_group=None, start_iter: int = 2, optimizer=None,
                **hook_kwargs):
    """Register ``cfg`` on a fresh DDP wrapper; returns the hook state (``None`` for dense).

    ``optimizer``: given to ``comms.register`` for our hooks (it takes SGD momentum over:
    momentum correction); torch's hooks leave it alone. ``hook_kwargs`` go to
    ``comms.register`` (e.g. ``warmup_steps``)."""
    if cfg.kind == "dense":
        return None
    if cfg.kind == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(process_group, default_hooks.fp16_compress_hook)
        return None
    if cfg.kind == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        st = powerSGD_hook.PowerSGDState(process_group=process_group,
                                         matrix_approximation_rank=cfg.rank,
                                         start_powerSGD_iter=max(2, start_iter),
                                         random_seed=0)
        ddp.register_comm_hook(st, powerSGD_hook.powerSGD_hook)
        return st
    if cfg.kind == "ours" and cfg.sync:  # communicate every H steps (hand-picked H, P, tau)
        import comms

        return comms.register(ddp, cfg.spec, process_group=process_group, optimizer=optimizer,
                              **dict(cfg.sync), **{k: v for k, v in hook_kwargs.items() if k != "warmup_steps"})
    if cfg.kind == "ours" and cfg.default:  # exactly what a user writes: nothing but the spec
        import comms

        return comms.register(ddp, cfg.spec, process_group=process_group, optimizer=optimizer,
                              **hook_kwargs)
    if cfg.kind == "ours":
        import comms

        return comms.register(ddp, cfg.spec, process_group=process_group, algorithm=cfg.algorithm,
                              error_feedback=cfg.error_feedback, start_iter=start_iter,
                              optimizer=optimizer, **hook_kwargs)
    raise ValueError(f"unknown hook kind {cfg.kind!r}")
