"""What the framework integrations share: option checks, optimizer pairing, resume warnings.

:func:`comms.register` pairs the hook with one optimizer (``optimizer=opt``: SGD's momentum
moves into the hook, the optimizer's goes to 0). Frameworks build their optimizers themselves,
wrap them (``LightningOptimizer``, Fabric's and Accelerate's wrappers) and sometimes build
several; :func:`register_paired` applies exactly ``register(..., optimizer=opt)`` to every
layout they produce, or refuses with the reason. :func:`check_options` validates a spec and
the options before any process starts (it builds a :class:`~comms.ddp.state.CompressionState`,
whose constructor validates without communicating).

Example::

    >>> from comms.integrations.pairing import check_options, register_paired
    >>> check_options("topk:density=0.01", {"algorithm": "allgather"})   # raises on bad input
    >>> state = register_paired(ddp_model, "topk:density=0.01", [opt], algorithm="allgather")
"""

from __future__ import annotations

import inspect
import logging
import types
import warnings
from typing import Any, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from ..core.checkpoint import settle
from ..core.pairing import ADAM_FREEZE_DEFAULT, check_adam_freeze
from ..outer.attach import SYNC_OPTIONS, check_outer_pairing, take_sync_options
from ..outer.optimizers import default_outer
from ..outer.sync import OuterSync
from ..ddp.registration import register
from ..ddp.state import CompressionState

__all__ = ["REGISTER_OPTIONS", "check_options", "unwrap_optimizer", "register_paired",
           "SeveralOptimizers", "repair_momentum", "warn_no_state", "MISSING_STATE", "summary",
           "find_ddp", "register_model"]

logger = logging.getLogger(__name__)

# the process group and communicator come from the framework, never from the user here
_FRAMEWORK_OWNED = ("self", "compressor", "process_group", "communicator")



def _register_options() -> tuple[str, ...]:
    """Keyword options of ``CompressionState`` (and of the options object its ``**options``
    go to, when it has one), plus ``register``'s own (``check_replicas_every``,
    ``adam_freeze``; its ``optimizer`` is the framework's) and the outer sync's (``sync_every``,
    ...: :data:`comms.outer.attach.SYNC_OPTIONS`)."""
    names, var = [], False
    for n, p in inspect.signature(CompressionState.__init__).parameters.items():
        var |= p.kind is p.VAR_KEYWORD
        if n not in _FRAMEWORK_OWNED and p.kind is p.KEYWORD_ONLY:
            names.append(n)
    if var:
        try:
            from ..core.options import PipelineOptions
        except ImportError:  # an older layout: every option is CompressionState's own
            PipelineOptions = None
        if PipelineOptions is not None:
            names += [n for n, p in inspect.signature(PipelineOptions.__init__).parameters.items()
                      if p.kind is p.KEYWORD_ONLY and n not in names]
    own = [n for n, p in inspect.signature(register).parameters.items()
           if p.kind is p.KEYWORD_ONLY and n != "optimizer" and n not in names]
    return tuple(names + own + [n for n in SYNC_OPTIONS if n not in names + own])


#: every option ``comms.register`` takes besides the model, spec and optimizer
REGISTER_OPTIONS: tuple[str, ...] = _register_options()

MISSING_STATE = ("commpress: the checkpoint %s holds no commpress state while compression is "
                 "on (%s): the error-feedback residuals, momentum velocities and autotune plan "
                 "restart from zero; a checkpoint saved through this integration resumes bitwise")


def check_options(compressor, options: dict[str, Any]) -> CompressionState:
    """Validate a spec and ``comms.register`` options without a model or process group.

    Args:
        compressor: a :class:`compressors.Compressor` or a spec string.
        options: keyword options of :func:`comms.register` (``algorithm``, ``momentum``, ...).

    Returns:
        A throw-away :class:`~comms.ddp.state.CompressionState` built from them (never registered).

    Raises:
        TypeError: an unknown option, or an option of the wrong type (naming it).
        ValueError: a bad spec, an unknown algorithm, an algorithm the compressor's families
            do not support, an out-of-range option, or a bad ``adam_freeze``.
    """
    unknown = sorted(set(options) - set(REGISTER_OPTIONS))
    if unknown:
        raise TypeError(f"unknown commpress option(s) {unknown}; the options are "
                        f"{sorted(REGISTER_OPTIONS)}")
    every = options.get("check_replicas_every")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
        raise TypeError(f"check_replicas_every must be an int >= 0 or None, got {every!r}")
    check_adam_freeze(options.get("adam_freeze", "auto"))
    kw = {k: v for k, v in options.items() if k not in ("check_replicas_every", "adam_freeze")}
    sync, _ = take_sync_options(kw)  # ValueError: outer-sync keywords without sync_every
    if sync is not None:
        _check_sync(compressor, sync, kw, options.get("adam_freeze", ADAM_FREEZE_DEFAULT))
    kw.setdefault("algorithm", "auto")  # register's default (comms.make_hook)
    return CompressionState(compressor, **kw)


def _check_sync(compressor, sync: dict, options: dict, adam_freeze) -> None:
    """``sync_every=H`` and its keywords as ``register`` checks them, on a probe parameter and
    a one-rank stand-in for the communicator (nothing is sent, no hook is attached)."""
    probe = torch.zeros(1, requires_grad=True)
    check_outer_pairing(torch.optim.SGD([probe], lr=0.0), adam_freeze, options, ADAM_FREEZE_DEFAULT)
    one_rank = types.SimpleNamespace(world_size=1, rank=0, backend=None)
    OuterSync([probe.detach()], one_rank, compressor, every=sync["sync_every"],
              fragments=sync.get("sync_fragments") or 1, delay=sync.get("sync_delay") or 0,
              outer=sync.get("outer") or default_outer(sync.get("outer_momentum")), outer_lr=sync.get("outer_lr"),
              outer_momentum=sync.get("outer_momentum"),
              **{k: options[k] for k in ("error_feedback", "seed", "timeout", "residual_bound", "algorithm")
                 if options.get(k) is not None})


def unwrap_optimizer(optimizer):
    """The ``torch.optim.Optimizer`` inside a framework's wrapper (``LightningOptimizer``,
    Fabric's ``_FabricOptimizer``, Accelerate's ``AcceleratedOptimizer``); their param groups
    are the inner optimizer's, so pairing the inner one pairs the wrapper."""
    for _ in range(4):
        inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _momenta(optimizers) -> list[float]:
    return [float(g.get("momentum", 0.0) or 0.0) for o in optimizers for g in o.param_groups]


def _check_heavy_ball(optimizer, where: str) -> None:
    for i, g in enumerate(optimizer.param_groups):
        if g.get("dampening", 0) or g.get("nesterov", False):
            raise ValueError(f"{where} param group {i} has dampening={g.get('dampening')!r}, "
                             f"nesterov={g.get('nesterov')!r}; the hook's momentum correction is "
                             "heavy-ball momentum (dampening 0, nesterov False)")


def register_paired(ddp_model, compressor, optimizers: Sequence, **options) -> CompressionState:
    """``comms.register(ddp_model, compressor, optimizer=opt, **options)`` for any number of
    (possibly wrapped) optimizers.

    One optimizer: exactly :func:`comms.register` with ``optimizer=``. None: ``register``
    without it. Several: they are paired as one (:class:`SeveralOptimizers`: every one is
    marked and watched for a resume); the hook applies one momentum to every gradient
    bucket, so every param group of every optimizer must have the same SGD momentum (taken
    over from all of them, each set to 0) or none; ``momentum=`` given: all must have
    momentum 0. Adam's momentum space pairs with one optimizer only.

    Raises:
        ValueError: optimizers or param groups with different momenta, or with dampening or
            Nesterov (nothing is changed); what :func:`comms.register` raises.
    """
    opts = [unwrap_optimizer(o) for o in optimizers]
    if options.get("momentum", 0) is None:  # register's take-over passes momentum= itself
        options = {k: v for k, v in options.items() if k != "momentum"}
    if len(opts) <= 1:
        return register(ddp_model, compressor, optimizer=opts[0] if opts else None, **options)
    momenta = _momenta(opts)
    if options.get("momentum") is None and any(momenta):
        if len(set(momenta)) != 1:
            raise ValueError(f"{len(opts)} optimizers with param-group momenta {momenta}: the "
                             "commpress hook applies one momentum to every gradient bucket; give "
                             "them one SGD momentum, or pass momentum= and run them with momentum 0")
        for i, o in enumerate(opts):
            _check_heavy_ball(o, f"optimizer {i} ({type(o).__name__})")
    return register(ddp_model, compressor, optimizer=SeveralOptimizers(opts), **options)


class SeveralOptimizers(torch.optim.Optimizer):
    """Several optimizers' param groups as one optimizer's (the same group dicts), for the
    pairing: the momenta it reads, takes over and marks are theirs, and the hooks registered
    on it go to each of them. It never steps itself."""

    def __init__(self, optimizers: Sequence):  # no Optimizer.__init__: it would copy the groups
        self.optimizers = list(optimizers)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self.defaults, self.state = {}, {}

    def register_step_pre_hook(self, hook):
        return [o.register_step_pre_hook(hook) for o in self.optimizers]

    def register_step_post_hook(self, hook):
        return [o.register_step_post_hook(hook) for o in self.optimizers]

    def register_load_state_dict_post_hook(self, hook, prepend: bool = False):
        return [o.register_load_state_dict_post_hook(hook, prepend) for o in self.optimizers]

    def step(self, closure=None):
        raise RuntimeError("SeveralOptimizers pairs optimizers with the hook; step each of them")


def repair_momentum(state: CompressionState | None, optimizers: Sequence, where: str) -> None:
    """After an optimizer state was loaded: if the hook applies momentum and a loaded param
    group came back with momentum (a checkpoint from a run without the take-over, e.g. plain
    DDP), set it to 0 again and warn — else momentum would be applied twice."""
    if state is None or getattr(state, "momentum", None) is None:
        return
    for o in (unwrap_optimizer(o) for o in optimizers):
        found = [float(g.get("momentum", 0.0) or 0.0) for g in o.param_groups]
        if any(found):
            for g in o.param_groups:
                g["momentum"] = 0.0
            logger.warning("commpress: %s restored optimizer momentum %s while the hook applies "
                           "momentum %s: set to 0 again (the optimizer's momentum buffers do not "
                           "carry over into the hook's velocity)", where, found, state.momentum)


def warn_no_state(source, spec: str, states: Sequence = ()) -> None:
    """The WARNING for a checkpoint without commpress state loaded while compressing;
    ``states``: the hook states it concerns, settled (their first step reports nothing more)."""
    logger.warning(MISSING_STATE, source, spec)
    for st in states:
        settle(st)


def summary(state) -> dict[str, Any]:
    """What the integrations log about one rank's hook: plain numbers and strings.

    Keys: ``iter``, ``wire_bytes`` and ``dense_bytes`` (what one rank sent in the last step
    and what dense would have sent), ``ratio`` (dense / wire), ``algorithm``, and for
    ``algorithm="auto"``: ``plan`` (the locked rule, ``None`` while tuning), ``locked``,
    ``tuning_steps``, ``tuning_cost_s``, ``tunings``.
    """
    if hasattr(state, "wire_bytes_per_step"):
        wire, dense = state.wire_bytes_per_step(), state.dense_bytes_per_step()
    else:  # FSDP/HSDP: the per-module records
        wire = sum(s.wire_bytes for s in state.stats.values())
        dense = sum(s.dense_bytes for s in state.stats.values())
    out = {"iter": int(getattr(state, "iter", 0)), "wire_bytes": int(wire), "dense_bytes": int(dense),
           "ratio": float(dense / wire) if wire else 1.0,
           "algorithm": str(getattr(state, "algorithm", None))}
    planner = getattr(state, "planner", None)
    tuner = getattr(planner, "tuner", None)
    if tuner is not None:
        out.update(plan=tuner.decision if tuner.locked else None, locked=bool(tuner.locked),
                   tuning_steps=int(tuner.tuning_steps), tuning_cost_s=float(tuner.tuning_cost_s),
                   tunings=int(tuner.tunings))
    return out


def find_ddp(model) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` in ``model``, looking through ``torch.compile``'s
    ``OptimizedModule`` and Fabric's ``_FabricModule``."""
    for _ in range(8):
        if model is None or isinstance(model, DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None) or getattr(model, "_forward_module", None)
    return None


def _fsdp2_root(model):
    """``model`` (through compile/Fabric wrappers) when it is a ``fully_shard`` module, else None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    for _ in range(8):
        if model is None or isinstance(model, FSDPModule):
            return model
        model = getattr(model, "_orig_mod", None) or getattr(model, "_forward_module", None)
    return None


def register_model(model, compressor, optimizers: Sequence, options: dict[str, Any], *,
                   world_size: int, framework: str, fix: str):
    """Register on whatever a framework's setup returned: DDP -> :func:`register_paired`;
    a ``fully_shard`` (FSDP2) module -> :func:`comms.fsdp.register`; one process -> a
    ``UserWarning`` and ``None``.

    Raises:
        TypeError: several processes and neither DDP nor FSDP2 (``fix`` says what to do), or an
            option ``comms.fsdp.register`` does not take.
    """
    ddp = find_ddp(model)
    root = None if ddp is not None else _fsdp2_root(model)
    if root is not None:  # comms.fsdp.register validates its own options
        return _register_fsdp(root, compressor, optimizers, options)
    check_options(compressor, options)  # also on one process: the same call fails later on two
    if ddp is not None:
        return register_paired(ddp, compressor, optimizers, **options)
    if world_size == 1:
        warnings.warn(f"commpress: {framework} runs one process and did not wrap the model in "
                      f"DistributedDataParallel ({type(model).__name__}): nothing to communicate, "
                      "no hook registered (returns None); the optimizer keeps its momentum",
                      UserWarning, stacklevel=3)
        return None
    raise TypeError(f"commpress' {framework} helper found no DistributedDataParallel and no FSDP2 "
                    f"module in {type(model).__name__}: {fix}")


def _register_fsdp(root, compressor, optimizers: Sequence, options: dict[str, Any]):
    from .. import fsdp

    params = inspect.signature(fsdp.register).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unsupported = sorted(k for k in options if k not in params)
        if unsupported:
            raise TypeError(f"comms.fsdp.register (FSDP2) takes no {unsupported}; it takes "
                            f"{sorted(k for k in params if k not in ('model', 'compressor'))}")
    kw = dict(options)
    opts = [unwrap_optimizer(o) for o in optimizers]
    if "optimizer" in params and len(opts) == 1:
        kw["optimizer"] = opts[0]
    elif any(_momenta(opts)) and kw.get("momentum") is None:
        raise ValueError(f"{len(opts)} optimizers with momenta {_momenta(opts)} on FSDP2: "
                         "comms.fsdp.register pairs with one optimizer; pass momentum= and run "
                         "the optimizers with momentum 0")
    return fsdp.register(root, compressor, **kw)
