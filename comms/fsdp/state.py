"""``FSDPCompressionState``: what the FSDP reduce-scatters / HSDP all-reduce hooks keep
between calls (residuals, velocities, algorithm stores, per-module step counters, the
``auto`` decisions), its report and its checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from compressors import Compressor
from compressors.blockquant import PARAM_BITS, BlockQuantizer

from ..algorithms import DENSE, get_algorithm
from ..core.checkpoint import check_owner, hash64, owner, plain, settle, to_device
from ..transport.communicator import TorchCommunicator
from ..core.config_check import ConfigCheck
from ..transport.heartbeat import HEARTBEAT
from ..transport.errors import where
from .params import GatherStats, resolve_params
from ..tuning.module_tuner import ModuleTuner
from ..tuning.router import FixedRouter, ModuleRouter
from .backward_end import BackwardEnd
from .unused import UnusedParams
from ..core.gradient_state import GradientState
from ..core.options import OPTION_FIELDS, PipelineOptions
from ..core.stats import stats_rows

__all__ = ["FSDPCompressionState", "FSDP_CONFIG_FIELDS", "HSDP_ALGORITHMS", "SCATTER_REDUCE"]

logger = logging.getLogger(__name__)

# what every rank must agree on for a module, in the order of the cross-rank config check
FSDP_CONFIG_FIELDS = ("compressor", "mode", "algorithm", "params", "seed", "start_iter", "error_feedback",
                      "module", "step", "numel", "dtype") + OPTION_FIELDS

HSDP_ALGORITHMS = ("allreduce", "allgather", "two_phase")
#: the FSDP-mode algorithm that compresses every reduce-scatter (``"auto"`` times it per module)
SCATTER_REDUCE = "scatter_reduce"


def _check_algorithm(c: Compressor, mode: str, algorithm):
    """The algorithm name for ``mode`` (``None``: the default), or a ValueError naming it."""
    if algorithm is not None and not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a str or None, got {algorithm!r}")
    if mode == "fsdp":
        if algorithm not in (None, "auto", SCATTER_REDUCE):
            raise ValueError(f"algorithm={algorithm!r} applies to the HSDP replicate all-reduce "
                             f"only (pass replicate_group); the FSDP reduce-scatter is {SCATTER_REDUCE!r} "
                             "(compressed on every call) or 'auto' (the default: dense or compressed "
                             "per module, by measured calls)")
        # the scatter-reduce needs every receiver to decode any rank's chunk payload
        # (allgather/two_phase families) and equal payloads per chunk (fixed size)
        if not (c.fixed_size and (c.supports("two_phase") or c.supports("allgather"))):
            raise ValueError(f"compressor {c.spec()!r} cannot compress the FSDP reduce-scatter: it "
                             "needs rank-decodable, fixed-size chunk payloads (identity, fp16, bf16, "
                             f"qsgd, sign, topk, randomk); {c.spec()!r} supports {list(c.families)}")
        return algorithm or "auto"
    flat = _default_flat(c) if algorithm in (None, "auto") else algorithm
    if flat not in HSDP_ALGORITHMS:
        raise ValueError(f"HSDP replicate all-reduce algorithm must be 'auto' or one of "
                         f"{HSDP_ALGORITHMS}, got {algorithm!r} (for {c.spec()!r})")
    if c.name == "powersgd":
        raise ValueError(f"compressor {c.spec()!r} cannot compress an HSDP shard: PowerSGD factors "
                         "whole matrices, and a shard is a flat slice across a module's parameters; "
                         "use qsgd, sign, topk, randomk, fp16 or bf16 on HSDP (PowerSGD serves DDP)")
    if flat is None or not get_algorithm(flat).supports(c):
        raise ValueError(f"compressor {c.spec()!r} cannot travel with {flat!r} on a flat "
                         f"FSDP shard (it supports {list(c.families)})")
    return flat if algorithm not in (None, "auto") else "auto"


def _default_flat(c: Compressor) -> str | None:
    """The HSDP replicate all-reduce's compressed algorithm: the first the compressor supports."""
    return next((a for a in HSDP_ALGORITHMS if c.supports(a)), None)


class FSDPCompressionState(GradientState):
    """State of the FSDP/HSDP adapters (:mod:`comms.fsdp.reduce_scatter`, :mod:`comms.fsdp.replicate`).

    Args:
        compressor: a :class:`compressors.Compressor` or a spec string.
        replicate_group: ``None``: FSDP mode; a ``ProcessGroup``: HSDP mode (see
            :mod:`comms.fsdp`). Not pickled.
        algorithm: ``"auto"`` (``None``, the default): each module is timed dense and
            compressed on its first calls after the warm-up and keeps the faster (the same
            decision on every rank). Compressed on every call: ``"scatter_reduce"`` (FSDP)
            or a flat algorithm name (HSDP: ``allreduce``, ``allgather``, ``two_phase``).
        params: the parameter all-gather (:mod:`comms.fsdp.params`): ``"auto"`` (``None``,
            the default), ``"full"``, ``"int8"`` or ``"int4"``.
        **options: :class:`~comms.core.options.PipelineOptions` (``error_feedback``, ``seed``,
            ``start_iter``, ``timeout``, ``momentum``, ``momentum_masking``, ``clip_norm``,
            ``residual_bound``, ``warmup_steps``), readable as attributes.

    Raises:
        TypeError / ValueError: a bad option or a compressor that cannot travel this way,
            naming it.

    Example::

        >>> state = FSDPCompressionState("sign")
        >>> state.state_dict()["compressor"]
        'sign:chunk=128'
    """

    def __init__(self, compressor: "Compressor | str", *, replicate_group=None,
                 algorithm: str | None = None, params: str | None = None, **options):
        super().__init__(PipelineOptions(compressor, **options))
        if replicate_group is not None and not isinstance(replicate_group, dist.ProcessGroup):
            hint = " (for a DeviceMesh pass mesh.get_group('replicate'))" \
                if "Mesh" in type(replicate_group).__name__ else ""
            raise TypeError(f"replicate_group must be a torch.distributed.ProcessGroup or None, got "
                            f"{type(replicate_group).__name__}{hint}")
        self.mode = "fsdp" if replicate_group is None else "hsdp"
        self.algorithm = _check_algorithm(self.compressor, self.mode, algorithm)
        self.params = resolve_params(params, self.mode, self.algorithm, self.compressor.name == "identity")
        self.param_codecs = {f"int{b}": BlockQuantizer(b) for b in PARAM_BITS}
        # a tie between full and int8 parameters goes to int8: the same measured quality, a
        # quarter of the bytes on a shared link (DDP's auto breaks ties by bytes too)
        self.gather_tuner = ModuleTuner(prefer_dense=-0.03) if self.params == "tuned" else None
        self.gather_stats: dict[int, GatherStats] = {}  # module index -> its parameter all-gathers
        self.replicate_group = replicate_group
        self.steps: dict[int, int] = {}          # module index -> calls so far (the RNG step)
        self.modules: list[str] = []             # module index -> fqn
        self.divide_factors: list[float] = []    # module index -> FSDP's post-sum divide factor
        self.tuner = ModuleTuner() if self.algorithm == "auto" else None
        self.outer = None  # comms.outer.OuterSync with register(..., sync_every=H)
        compressed = SCATTER_REDUCE if self.mode == "fsdp" else self.flat_algorithm()
        self.router = FixedRouter(compressed) if self.tuner is None else ModuleRouter(self.tuner, compressed)
        self._new_helpers()

    _TRANSIENT = GradientState._TRANSIENT + ("replicate_group", "_comms", "config_check", "backward_end",
                                             "unused")

    def _new_helpers(self) -> None:
        self.config_check = ConfigCheck(FSDP_CONFIG_FIELDS)
        self._comms: dict[int, TorchCommunicator] = {}
        self.backward_end = BackwardEnd()        # the overlapped reduce-scatters, the unused drop
        self.unused = UnusedParams()             # parameters without a gradient this backward

    def _reset_transient(self) -> None:
        """Unpickled: without process groups."""
        super()._reset_transient()
        self.replicate_group = None
        self._new_helpers()

    # -- per call ------------------------------------------------------------------------
    def comm_for(self, group) -> TorchCommunicator:
        c = self._comms.get(id(group))
        if c is None:
            c = self._comms[id(group)] = TorchCommunicator(group)
            if c.world_size > 1 and c.backend in ("gloo", "nccl"):
                HEARTBEAT.start()  # once per process: names a dead or silent peer in errors
        if self.timeout is not None:
            c.timeout = self.timeout  # the user's bound wins over the group's
        return c

    @property
    def native(self) -> bool:
        """The identity compressor under ``algorithm="auto"`` with nothing to do locally (no
        momentum, clipping, error feedback): FSDP's own collectives and arithmetic carry the
        gradients, bounded (:mod:`comms.fsdp.bounded`) — bitwise plain FSDP2 / native HSDP at
        any world size. A pinned algorithm runs the engine's path."""
        return (self.compressor.name == "identity" and self.algorithm == "auto" and not self.local_transform
                and not self.error_feedback and self.residual_bound is None)

    def where(self, comm, what: str, index: int, numel: int, dtype, step: int) -> str:
        """The name of one module call in errors: collective, module, step, rank."""
        return where(comm, what, index, numel, dtype, step,
                     unit=f"module {self.modules[index] or '<root>'!r}" if index < len(self.modules) else None)

    def flat_algorithm(self) -> str | None:
        """The compressed algorithm (HSDP: a flat algorithm; FSDP: ``None``, the scatter-reduce)."""
        if self.mode == "fsdp":
            return None
        return self.algorithm if self.algorithm != "auto" else _default_flat(self.compressor)

    def begin(self, index: int, comm, x: torch.Tensor) -> int:
        """Before a module's data moves: the config check (once per layout, collective) and,
        at the first module of a step, the replica guard. Returns this call's step."""
        step = self.steps.get(index, 0)
        self.config_check.check(
            comm, index, x, step,
            lambda: [hash64(v) for v in self.config_values(index, x.numel(), x.dtype, step)],
            lambda: self.config_values(index, x.numel(), x.dtype, step))
        if index == 0 and self.replica_guard is not None:
            self.replica_guard.maybe_check(step, comm)
        return step

    def clip_limit(self, index: int, world: int) -> float | None:
        """The norm limit of what one rank feeds in for module ``index``: FSDP divides the sum
        of ``world`` contributions by the module's divide factor afterwards, so a
        contribution ``x`` counts as ``x / factor`` and may have norm
        ``clip_norm * factor / world`` (the averaged gradient then has norm <= clip_norm)."""
        if self.clip_norm is None:
            return None
        return self.clip_norm * self.divide_factors[index] / world

    def config_values(self, index: int, numel: int, dtype, step: int) -> tuple:
        return (self.compressor.spec(), self.mode, self.algorithm, self.params, self.seed, self.start_iter,
                self.error_feedback, self.modules[index], step, numel, str(dtype)) + tuple(
                    getattr(self, k) for k in OPTION_FIELDS)

    @property
    def nonfinite_modules(self) -> int:
        """How many (module, step) reductions were non-finite and NaN-filled (reads the device)."""
        return self.nonfinite_calls

    def report(self) -> str:
        """Per-module table: numel, route, dense and wire bytes one rank sends per step."""
        rows = stats_rows(self.stats, "module", lambda i: self.modules[i] or "<root>")
        rows.append(f"compressor={self.compressor.spec()} mode={self.mode} algorithm={self.algorithm} "
                    f"error_feedback={self.error_feedback} residual bytes={self.residual_bytes()} "
                    f"layout resets={self.memory.layout_resets}")
        if self.tuner is not None:
            rows.append(str(self.tuner))
        for i, g in sorted(self.gather_stats.items()):
            rows.append(f"params {self.modules[i] or '<root>'}: {g.calls} all-gathers, "
                        f"{g.wire_bytes} of {g.dense_bytes} bytes sent, codec {g.codec_s * 1e3:.1f} ms")
        rows.append(f"reduce-scatters overlapping backward: {self.backward_end.deferred_calls}")
        rows.append(f"params={self.params}" + ("" if self.gather_tuner is None else
                                               f" ({str(self.gather_tuner).replace('auto: ', '')})"))
        return "\n".join(rows)

    # -- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers (``torch.load(weights_only=True)`` reads it); per rank."""
        return {
            "kind": "fsdp", **owner(), **self.options.as_dict(), "mode": self.mode,
            "algorithm": self.algorithm, "modules": list(self.modules),
            "steps": {int(i): int(s) for i, s in self.steps.items()},
            "memory": self.memory.state_dict(),
            "algo_store": {int(i): plain(d, f"algo_store[{i}]") for i, d in self.algo_store.items()},
            "nonfinite_modules": self.nonfinite_modules,
            "tuner": None if self.tuner is None else self.tuner.state_dict(),
            "params": self.params,
            "gather_tuner": None if self.gather_tuner is None else self.gather_tuner.state_dict(),
            "gather_calls": {int(i): int(r.calls) for i, r in self.gather_stats.items()},
            "adam": None if self.adam is None else self.adam.state_dict(),
            "outer": None if self.outer is None else self.outer.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any], device=None) -> None:
        """Restore :meth:`state_dict` (this rank's own file); validates before changing anything.

        Raises:
            TypeError: not a dict from :meth:`state_dict`.
            ValueError: saved with other options, mode, algorithm or FSDP modules.
        """
        if not isinstance(sd, dict) or sd.get("kind") != "fsdp":
            raise TypeError(f"load_state_dict needs a dict from FSDPCompressionState.state_dict(), "
                            f"got {type(sd).__name__}")
        check_owner(sd)  # per rank: another rank's file raises
        self.options.check_saved(sd, min((int(s) for s in sd["steps"].values()), default=0))
        for key, mine in (("mode", self.mode), ("algorithm", self.algorithm), ("params", self.params),
                          ("error_feedback", self.error_feedback), ("modules", list(self.modules))):
            if sd.get(key) != mine:
                raise ValueError(f"state was saved with {key}={sd.get(key)!r}, this model uses {mine!r}")
        if (self.outer is None) != (sd.get("outer") is None):
            raise ValueError("state was saved " + ("with" if sd.get("outer") is not None else "without")
                             + " sync_every, this run " + ("uses it" if self.outer is not None else "does not"))
        if self.outer is not None:
            self.outer.load_state_dict(sd["outer"])  # validates before changing anything
        self.seed = int(sd["seed"])
        self.steps = {int(i): int(s) for i, s in sd["steps"].items()}
        self.memory.load_state_dict(sd["memory"], device=device)
        self.algo_store = {int(i): to_device(d, device) for i, d in sd["algo_store"].items()}
        n = int(sd.get("nonfinite_modules", 0))
        self._nonfinite = n
        if self.tuner is not None and sd.get("tuner") is not None:
            self.tuner.load_state_dict(sd["tuner"])
        if self.gather_tuner is not None and sd.get("gather_tuner") is not None:
            self.gather_tuner.load_state_dict(sd["gather_tuner"])
        # the call counts index the parameter all-gathers' tuning, as steps index the gradients'
        self.gather_stats = {int(i): GatherStats(calls=int(c)) for i, c in sd.get("gather_calls", {}).items()}
        if self.adam is not None and sd.get("adam") is not None:
            self.adam.load_state_dict(sd["adam"])
        settle(self)

