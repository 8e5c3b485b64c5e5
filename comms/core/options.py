"""``PipelineOptions``: the training options of the gradient pipeline, validated once for
every entry point (the DDP hook, the FSDP reduce-scatter, the HSDP all-reduce hook).

One object validates the options (a clear error naming the bad value, before anything is
registered or communicated), lists what every rank must agree on (the cross-rank
configuration check), writes them into checkpoints and refuses a checkpoint saved with other
options. The stages that use them live in :mod:`comms.core.stages`.
"""

from __future__ import annotations

from typing import Any

from compressors import Compressor, from_spec

from ..transport.waits import check_timeout

__all__ = ["PipelineOptions", "OptionsView", "MASKING_MODES", "OPTION_FIELDS", "check_masking"]

MASKING_MODES = ("held", "sent", "off")

#: the options a checkpoint records and a resumed run must match
OPTION_FIELDS = ("momentum", "momentum_masking", "clip_norm", "residual_bound", "warmup_steps")


def _int(name: str, value, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return value


def _momentum(momentum):
    if momentum is None:
        return None
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise TypeError(f"momentum must be a number in [0, 1) or None, got {momentum!r}")
    if not (0.0 <= float(momentum) < 1.0):
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    return float(momentum)


def check_masking(momentum_masking) -> str:
    """``momentum_masking`` as one of :data:`MASKING_MODES` (``True``: ``"sent"``, DGC's rule;
    ``False``: ``"off"``)."""
    if momentum_masking is True or momentum_masking is False:
        return "sent" if momentum_masking else "off"
    if isinstance(momentum_masking, str) and momentum_masking in MASKING_MODES:
        return momentum_masking
    raise TypeError(f"momentum_masking must be one of {MASKING_MODES} or a bool, got "
                    f"{momentum_masking!r}")


def _clip(clip_norm):
    if clip_norm is None:
        return None
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)):
        raise TypeError(f"clip_norm must be a positive number or None, got {clip_norm!r}")
    if not (0.0 < float(clip_norm) < float("inf")):
        raise ValueError(f"clip_norm must be a finite number > 0, got {clip_norm!r}")
    return float(clip_norm)


def _residual_bound(bound, compressor):
    if bound == "auto":
        bound = getattr(compressor, "default_residual_bound", None)
    if bound is None:
        return None
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) \
            or not (1.0 <= float(bound) < float("inf")):
        raise ValueError(f"residual_bound must be 'auto', None or a finite number >= 1, got {bound!r}")
    return float(bound)


def _warmup(steps, compressor) -> int:
    if steps == "auto":
        steps = getattr(compressor, "default_warmup_steps", 0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"warmup_steps must be 'auto' or an int >= 0, got {steps!r}")
    return steps


class PipelineOptions:
    """The options every entry point shares (DDP, FSDP, HSDP), validated.

    Args:
        compressor: a :class:`compressors.Compressor` or a spec string (``"topk:density=0.01"``).
        error_feedback: keep residuals. ``None``: on for biased compressors (top-k, random-k,
            sign, casts), off for unbiased ones (QSGD: its residual grows without bound).
        start_iter: steps of plain (uncompressed) reduction first.
        seed: shared seed of the hash RNG streams (must match on all ranks).
        timeout: seconds (or a ``timedelta``) any commpress wait may last before it raises
            ``comms.CollectiveTimeout``; ``None``: the process group's timeout.
        momentum: Deep Gradient Compression's momentum correction: each rank keeps its SGD
            velocity ``u <- momentum * u + g`` and compresses ``u`` (plus the residual); the
            optimizer must then run with momentum 0 (``register(..., optimizer=opt)`` takes it
            over). ``None``: off.
        momentum_masking: with ``momentum`` and a sparsifier, where the velocity is zeroed:
            ``"held"`` (default) where the aggregate held back what this rank sent (only
            algorithms that compress again after the sum can); ``"sent"`` (``True``, DGC's
            rule) wherever this rank sent; ``"off"`` (``False``) never.
        clip_norm: local clipping: each rank scales its share of a bucket so that the
            averaged bucket has L2 norm <= ``clip_norm``. ``None``: off (no default: the
            threshold carries the model's gradient scale).
        residual_bound: bound the error-feedback input ``x + r`` to ``residual_bound * |x|``
            (L2, per bucket). ``"auto"``: the compressor's ``default_residual_bound`` (5 for
            random-k, none for the others); ``None``: off.
        warmup_steps: the first ``warmup_steps`` compressed steps use milder variants of the
            compressor (``Compressor.warmup``); a variant that keeps more than 15% of the
            elements, or sends more than half a dense step's bytes, sends the bucket dense.
            ``"auto"``: the compressor's ``default_warmup_steps`` (5 for top-k, 0 otherwise).

    Raises:
        TypeError / ValueError: a bad option, naming it.

    Example::

        >>> opts = PipelineOptions("topk:density=0.01", momentum=0.9)
        >>> opts.warmup_steps, opts.error_feedback
        (5, True)
    """

    __slots__ = ("compressor", "error_feedback", "start_iter", "seed", "timeout", "momentum",
                 "momentum_masking", "clip_norm", "residual_bound", "warmup_steps", "_warm")

    def __init__(self, compressor: "Compressor | str", *, error_feedback: bool | None = None,
                 start_iter: int = 0, seed: int = 0, timeout=None, momentum: float | None = None,
                 momentum_masking: "str | bool" = "held", clip_norm: float | None = None,
                 residual_bound: "float | str | None" = "auto", warmup_steps: "int | str" = "auto"):
        if not isinstance(compressor, (str, Compressor)):
            raise TypeError(f"compressor must be a spec string or a compressors.Compressor, "
                            f"got {compressor!r}")
        self.compressor = c = from_spec(compressor)
        self.timeout = check_timeout(timeout)
        self.start_iter = _int("start_iter", start_iter)
        self.seed = _int("seed", seed, low=-(1 << 63))
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True, False or None, got {error_feedback!r}")
        self.error_feedback = (not c.unbiased) if error_feedback is None else error_feedback
        self.momentum = _momentum(momentum)
        self.momentum_masking = check_masking(momentum_masking)
        self.clip_norm = _clip(clip_norm)
        self.residual_bound = _residual_bound(residual_bound, c)
        self.warmup_steps = _warmup(warmup_steps, c)
        self._warm: dict = {}

    @property
    def local_transform(self) -> bool:
        """True when each rank's gradient changes before the collective (momentum correction
        or clipping): then every step, the dense ones too, goes through the local steps."""
        return self.momentum is not None or self.clip_norm is not None

    def compressor_at(self, step: int) -> Compressor:
        """The compressor for ``step``: a warm-up variant during the first ``warmup_steps``
        compressed steps, else the compressor itself (``step`` is shared: every rank picks the
        same)."""
        k = step - self.start_iter
        if k >= self.warmup_steps or k < 0:
            if self._warm:
                self._warm.clear()
            return self.compressor
        comp = self._warm.get(k)
        if comp is None:
            self._warm.clear()  # one variant alive at a time
            comp = self._warm[k] = self.compressor.warmup((k + 1) / (self.warmup_steps + 1))
        return comp

    def as_dict(self) -> dict[str, Any]:
        """The options as plain values (checkpoints, the config check)."""
        return {"compressor": self.compressor.spec(), "error_feedback": self.error_feedback,
                "start_iter": self.start_iter, "seed": self.seed,
                **{k: getattr(self, k) for k in OPTION_FIELDS}}

    def check_saved(self, sd: dict[str, Any], saved_step: int) -> None:
        """Raise ``ValueError`` when checkpoint ``sd`` was saved with other options; the
        warm-up length only matters while a ramp is not over at ``saved_step``."""
        if sd.get("compressor", self.compressor.spec()) != self.compressor.spec():
            raise ValueError(f"state was saved with compressor {sd['compressor']!r}, "
                             f"this run uses {self.compressor.spec()!r}")
        saved = dict(sd)
        if "momentum_masking" in saved:
            saved["momentum_masking"] = check_masking(saved["momentum_masking"])
        ramps_end = self.start_iter + max(int(saved.get("warmup_steps", 0)), self.warmup_steps)
        if saved_step >= ramps_end:
            saved.pop("warmup_steps", None)  # both ramps are over: the count changes no step
        for key in OPTION_FIELDS:
            if saved.get(key, getattr(self, key)) != getattr(self, key):
                raise ValueError(f"state was saved with {key}={saved[key]!r}, this run uses "
                                 f"{key}={getattr(self, key)!r}")


def _forward(name: str) -> property:
    def get(self):
        return getattr(self.options, name)

    def set_(self, value):
        setattr(self.options, name, value)

    return property(get, set_, doc=f"``options.{name}`` (:class:`PipelineOptions`).")


class OptionsView:
    """Mixin: a hook state's ``options`` (a :class:`PipelineOptions`) read as its own
    attributes (``state.momentum``, ``state.compressor_at(step)``, ...)."""

    __slots__ = ()

    compressor = _forward("compressor")
    error_feedback = _forward("error_feedback")
    start_iter = _forward("start_iter")
    seed = _forward("seed")
    timeout = _forward("timeout")
    momentum = _forward("momentum")
    momentum_masking = _forward("momentum_masking")
    clip_norm = _forward("clip_norm")
    residual_bound = _forward("residual_bound")
    warmup_steps = _forward("warmup_steps")
    _warm = _forward("_warm")

    @property
    def local_transform(self) -> bool:
        return self.options.local_transform

    def compressor_at(self, step: int) -> Compressor:
        """See :meth:`PipelineOptions.compressor_at`."""
        return self.options.compressor_at(step)
