"""How a commpress state pairs with the training optimizer, for every entry point (DDP, FSDP2,
HSDP, the framework integrations).

Error feedback meeting an optimizer's momentum diverges for aggressive biased compressors
(top-k 1%, sign, random-k 1% on SGD momentum 0.9). The state applies the momentum itself
instead (``momentum=``, Deep Gradient Compression's momentum correction) and the optimizer runs
with momentum 0: :func:`pair_optimizer` reads SGD's momentum from the optimizer and sets it to 0
— for the compressors whose ``momentum_correction`` is True; PowerSGD's is False: it leaves the
momentum with the optimizer (applied to the averaged, decoded gradient, as in the paper and
torch's hook). Adam/AdamW with a compressor that keeps error-feedback residuals goes to momentum
space (:func:`adam_pairing`, :mod:`comms.core.adam`). :func:`check_pairing` refuses, before
anything changes, an optimizer of another model and an ``adam_freeze`` that does not apply.
"""

from __future__ import annotations

import logging
import warnings
import weakref

import torch

from .adam import FrozenVarianceAdam, adam_family, momentum_space
from .adam_policy import check_freeze
from .checkpoint import owner, settle, settled
from ..transport.notices import notice
from .replicas import ReplicaGuard

__all__ = ["ADAM_FREEZE_DEFAULT", "take_over_momentum", "check_optimizer", "pair_optimizer",
           "give_back_momentum", "check_pairing", "adam_pairing", "replica_guard",
           "check_adam_freeze", "paired_momentum", "mark_paired", "PAIRED_KEY", "UNRESTORED"]

logger = logging.getLogger(__name__)

#: the param-group key :func:`pair_optimizer` sets: the momentum the hook applies (0.0: none).
#: It travels in ``opt.state_dict()``, so a resumed run is recognised.
PAIRED_KEY = "commpress_momentum"

UNRESTORED = ("commpress (rank %d): the optimizer was restored from a commpress run's checkpoint "
              "but this rank's commpress state (%s) was not loaded before the first step: "
              "error-feedback residuals, momentum velocities, the Adam freeze and the autotune "
              "plan restart from zero. Save state.state_dict() on every rank and load this rank's "
              "own with state.load_state_dict() after register")


class _Default(str):
    """A default told apart from the same value given explicitly (``x is DEFAULT``)."""


#: ``adam_freeze``'s default: ``"auto"`` where an Adam pairing applies, silently nothing where
#: none does (an explicit value there is an error)
ADAM_FREEZE_DEFAULT = _Default("auto")

def _group_momenta(optimizer) -> list[float]:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return [float(g.get("momentum", 0.0) or 0.0) for g in optimizer.param_groups]


def take_over_momentum(optimizer) -> float | None:
    """What ``register(..., optimizer=opt)`` does to ``opt``: read its SGD momentum and set it
    to 0 in every param group, so the hook's momentum correction replaces it.

    Returns:
        The momentum taken over, or ``None`` when ``opt`` has none (momentum 0, or an optimizer
        without a ``momentum`` setting such as Adam — left unchanged).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: param groups with different momenta, ``dampening != 0`` or
            ``nesterov=True`` (the hook implements SGD's default heavy-ball momentum only);
            nothing is changed.
    """
    momenta = _group_momenta(optimizer)
    if not any(momenta):
        return None
    if len(set(momenta)) != 1:
        raise ValueError(f"the optimizer's param groups have different momenta {momenta}; the "
                         "hook applies one momentum to every bucket: pass momentum= yourself")
    for i, g in enumerate(optimizer.param_groups):
        if g.get("dampening", 0) or g.get("nesterov", False):
            raise ValueError(f"param group {i} has dampening={g.get('dampening')!r}, "
                             f"nesterov={g.get('nesterov')!r}; the hook's momentum correction is "
                             "heavy-ball momentum (dampening 0, nesterov False)")
    for g in optimizer.param_groups:
        g["momentum"] = 0.0
    return momenta[0]


def _wants_correction(state) -> bool:
    """Error feedback whose compressor wants the momentum in the hook (DGC's correction)."""
    return state.error_feedback and getattr(state.compressor, "momentum_correction", True)


def check_optimizer(state, optimizer) -> None:
    """Check the momentum pairing of a hook state and an optimizer.

    Raises:
        ValueError: the hook applies momentum (``state.momentum``) and the optimizer does too
            (momentum would be applied twice).

    Warns (``UserWarning``) when the hook keeps error-feedback residuals, applies no momentum,
    and the optimizer has momentum: the combination that diverges for aggressive biased
    compressors (not for those with ``momentum_correction = False``: PowerSGD) — pass ``momentum=`` (and momentum 0 to the optimizer) or
    ``register(..., optimizer=opt)``.
    """
    momenta = _group_momenta(optimizer)
    if state.momentum is not None and any(momenta):
        raise ValueError(f"the hook applies momentum {state.momentum} (momentum correction) and "
                         f"the optimizer has momentum {momenta}: it would be applied twice; run "
                         "the optimizer with momentum=0")
    if state.momentum is None and _wants_correction(state) and any(momenta):
        warnings.warn(f"commpress: error feedback ({state.compressor.spec()!r}) with the "
                      f"optimizer's momentum {max(momenta)} can diverge; let the hook apply it: "
                      "register(model, spec, optimizer=opt) or momentum= with an optimizer "
                      "momentum of 0", UserWarning, stacklevel=2)


def adam_pairing(state, optimizer, adam_freeze, comm_fn=None, iter_fn=None, replicated: bool = True):
    """The momentum-space scheme for an Adam/AdamW ``optimizer`` and a compressor that keeps
    error-feedback residuals (:func:`comms.core.adam.momentum_space`); ``None`` otherwise or when
    ``adam_freeze`` is ``None`` (the gradient path). ``comm_fn``/``iter_fn``: the communicator
    its freeze agreement uses and the step counter (default: the DDP state's).

    ``replicated`` (DDP: every rank holds the whole variance): preconditioned; sign travels as
    1-bit Adam's shared momentum, the sparsifiers as a velocity per rank without masking.
    Otherwise (FSDP): a velocity per rank with DGC's masking (docs/design-notes.md, "Adam(W)'s
    momentum space").

    Raises:
        ValueError: a bad ``adam_freeze`` value or an optimizer layout the scheme cannot
            follow, before anything changes.
    """
    check_freeze(adam_freeze)
    if adam_freeze is None or _no_adam_pairing(state, optimizer) is not None:
        return None
    mode = "local" if getattr(state.compressor, "sparsifies", False) else "shared"
    kw = dict(precondition=True, velocity_masking="off") if replicated else dict(velocity_masking="sent")
    adam = FrozenVarianceAdam(optimizer, mode=mode, freeze=str(adam_freeze) if isinstance(adam_freeze, _Default)
                              else adam_freeze, min_steps=max(10, state.start_iter + state.warmup_steps + 1), **kw)
    adam.comm_fn = comm_fn or state.comm
    adam.iter_fn = iter_fn or (lambda: state.iter)
    return adam


#: raises ``ValueError`` unless ``adam_freeze`` is ``"auto"``, ``None`` or an int >= 1
check_adam_freeze = check_freeze


def _no_adam_pairing(state, optimizer, sparsifiers_only: bool = False) -> str | None:
    """Why no Adam pairing applies to ``state`` and ``optimizer`` (``None``: one does)."""
    if optimizer is None:
        return "no optimizer= was given"
    if not adam_family(optimizer):
        return f"the optimizer is {type(optimizer).__name__}, not torch.optim.Adam/AdamW"
    spec = state.compressor.spec()
    if not momentum_space(state.compressor, state.error_feedback):
        return (f"{spec!r} keeps Adam's gradient path (momentum space serves biased compressors "
                "with error feedback: top-k, random-k, sign)")
    if sparsifiers_only and not getattr(state.compressor, "sparsifies", False):
        return f"{spec!r} keeps Adam's gradient path on FSDP/HSDP (momentum space serves top-k, random-k)"
    return None


def check_pairing(state, optimizer, adam_freeze, named_parameters, sparsifiers_only: bool = False) -> None:
    """Before anything changes: ``optimizer`` trains this model (it holds some of its trainable
    parameters: the hook takes its momentum over and pairs with its steps; several optimizers
    may share a model), and an explicit ``adam_freeze`` applies (an explicit ``None`` — the
    gradient path — always does).

    Raises:
        ValueError: an optimizer of another model, a bad ``adam_freeze`` value, or why
            ``adam_freeze`` does not apply."""
    check_freeze(adam_freeze)
    if optimizer is not None:
        _group_momenta(optimizer)  # a TypeError for a non-optimizer, first
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        trainable, mine = [n for n, _ in named], {id(p) for _, p in named}
        if trainable and not held & mine:
            total = sum(1 for g in optimizer.param_groups for _ in g["params"])
            raise ValueError(f"optimizer= holds none of the model's {len(trainable)} trainable "
                             f"parameters (first: {trainable[0]!r}) among the {total} tensor(s) it "
                             "holds: pass the optimizer that trains this model (its momentum is "
                             "taken over and paired with the hook)")
    if adam_freeze is ADAM_FREEZE_DEFAULT or adam_freeze is None:
        return
    why = _no_adam_pairing(state, optimizer, sparsifiers_only)
    if why is not None:
        raise ValueError(f"adam_freeze={adam_freeze!r} does not apply: {why}; leave it out "
                         "(or pass None)")


def replica_guard(module, check_replicas_every, **kw):
    """A :class:`~comms.core.replicas.ReplicaGuard` for ``check_replicas_every`` (``None``/0: off);
    raises naming a bad value."""
    if check_replicas_every:
        return ReplicaGuard(module, check_replicas_every, **kw)
    if check_replicas_every not in (None, 0) or isinstance(check_replicas_every, bool):
        raise TypeError(f"check_replicas_every must be an int, got {check_replicas_every!r}")
    return None


def pair_optimizer(optimizer, build, kwargs: dict, check=None):
    """Build a hook state with ``build(**kwargs)`` paired with ``optimizer`` as
    :func:`register` describes: SGD momentum taken over (validated with a probe state first,
    so a bad option changes nothing), the pairing checked, or a warning without an optimizer.
    ``check(probe)``: raises before anything changes (:func:`check_pairing`).

    The optimizer's param groups are marked (:data:`PAIRED_KEY`: the momentum the hook
    applies). An optimizer that comes marked was restored from a commpress run's checkpoint:
    its saved momentum is 0, so the hook takes the marked momentum. Marked at registration or
    loaded marked afterwards, a state not loaded (``state.load_state_dict``) by the next
    ``optimizer.step()`` is reported once (WARNING).

    Returns:
        ``(state, taken)``: ``taken`` what was changed on ``optimizer`` (``None``: nothing),
        for :func:`give_back_momentum` if registering fails afterwards.
    """
    taken, resumed = None, None
    if check is not None:
        check(build(**kwargs))  # validates the options too, before anything changes
    if optimizer is not None:
        momenta = _group_momenta(optimizer)  # TypeError before anything changes
        resumed = paired_momentum(optimizer)
        source = momenta[0] if any(momenta) else resumed
        if kwargs.get("momentum") is None and source:
            probe = build(**{**kwargs, "momentum": source})  # validate the rest first
            if getattr(probe.compressor, "momentum_correction", True):
                taken = take_over_momentum(optimizer) if any(momenta) else None
                kwargs = {**kwargs, "momentum": source if taken is None else taken}
    state = build(**kwargs)
    if optimizer is not None:
        check_optimizer(state, optimizer)
        taken = _Taken(taken, [g.get(PAIRED_KEY) for g in optimizer.param_groups])
        mark_paired(optimizer, state.momentum)
        _watch_resume(state, optimizer, armed=resumed is not None)
    elif state.momentum is None and _wants_correction(state):
        logger.warning("commpress: %r keeps error-feedback residuals and was not told the "
                       "optimizer's momentum; with SGD momentum pass register(..., optimizer=opt) "
                       "(or momentum= and an optimizer momentum of 0): error feedback meeting an "
                       "optimizer's momentum can diverge", state.compressor.spec())
    return state, taken


class _Taken:
    """What :func:`pair_optimizer` changed: the momentum taken over, the previous marks."""

    __slots__ = ("momentum", "marks")

    def __init__(self, momentum, marks):
        self.momentum, self.marks = momentum, marks


def paired_momentum(optimizer) -> float | None:
    """The momentum a commpress hook applied for ``optimizer`` when its param groups were
    marked (restored from a commpress run's checkpoint; 0.0: none), else ``None``."""
    marks = [g[PAIRED_KEY] for g in optimizer.param_groups if g.get(PAIRED_KEY) is not None]
    return float(marks[0]) if marks else None


def mark_paired(optimizer, momentum) -> None:
    """Mark every param group of ``optimizer`` with the momentum the hook applies."""
    for g in optimizer.param_groups:
        g[PAIRED_KEY] = float(momentum or 0.0)


def _watch_resume(state, optimizer, armed: bool) -> None:
    """Report a commpress state not loaded by the first ``optimizer.step()`` after the
    optimizer came from a commpress run's checkpoint: at registration (``armed``) or loaded
    afterwards (its groups carry the mark). A checkpoint without the mark (a plain run's) gets
    it back: the hook's momentum is still what the optimizer's 0 stands for."""
    ref, flags = weakref.ref(state), {"armed": armed}

    def loaded(opt):
        st = ref()
        if st is None:
            return
        if paired_momentum(opt) is None:
            mark_paired(opt, st.momentum)
        else:
            flags["armed"] = True

    def check(opt, args, kwargs):
        if not flags["armed"]:
            return None
        flags["armed"] = False
        st = ref()
        if st is not None and not settled(st):
            settle(st)
            notice(logger, UNRESTORED, owner()["rank"], st.compressor.spec())
        return None

    optimizer.register_step_pre_hook(check)
    optimizer.register_load_state_dict_post_hook(loaded)


def give_back_momentum(optimizer, taken) -> None:
    """Undo :func:`pair_optimizer` on ``optimizer`` (a registration that failed afterwards)."""
    if taken is None:
        return
    momentum = taken.momentum if isinstance(taken, _Taken) else taken
    if momentum is not None:
        for g in optimizer.param_groups:
            g["momentum"] = momentum
    if isinstance(taken, _Taken):
        for g, mark in zip(optimizer.param_groups, taken.marks):
            if mark is None:
                g.pop(PAIRED_KEY, None)
            else:
                g[PAIRED_KEY] = mark
