"""``CompressionState``: everything the DDP compression hook keeps between calls.

What is persisted by :meth:`CompressionState.state_dict` (all plain tensors and numbers,
readable with ``torch.load(weights_only=True)``): the iteration counter, the error-feedback
residuals, every algorithm's per-bucket store (``state.algo_store``: two-phase owner
residuals, PowerSGD P/Q, ...), the bucket layouts the residuals belong to, and the
configuration they were made with. Residuals and stores are **per rank**: save one file per
rank and load each rank's own file.

Contract for algorithm authors: ``store`` dicts hold tensors, numbers, strings, ``None`` and
lists/tuples/dicts of those — anything else makes ``state_dict()`` raise ``TypeError``.

The training options (momentum correction, clipping, warm-up, residual bound, timeout) are a
:class:`~comms.core.options.PipelineOptions`, shared with the FSDP/HSDP state; the hook's
transient helpers live in their own modules (config_check, step_flags, layouts, stats).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from compressors import Compressor

from ..algorithms import ALGORITHMS, default_algorithm, get_algorithm
from ..core.checkpoint import check_owner, hash64, owner, plain, settle, to_device
from ..transport.communicator import Communicator, TorchCommunicator
from ..core.config_check import ConfigCheck
from .layouts import LayoutTracker
from ..core.gradient_state import GradientState
from ..tuning.router import FixedRouter, PlannerRouter
from ..core.options import PipelineOptions
from ..core.stats import BucketStats, stats_rows
from .step_flags import StepFlags

__all__ = ["CompressionState", "BucketStats", "CONFIG_FIELDS"]

logger = logging.getLogger(__name__)

# what every rank must agree on for a bucket, in the order of the cross-rank config check
CONFIG_FIELDS = ("compressor", "algorithm", "seed", "start_iter", "error_feedback",
                 "min_compress_numel", "step", "numel", "dtype", "momentum", "momentum_masking",
                 "clip_norm", "residual_bound", "warmup_steps")


def check_group(process_group, communicator) -> None:
    """Raise ``TypeError``/``ValueError`` for a bad ``process_group``/``communicator`` pair."""
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        hint = " (for a DeviceMesh pass mesh.get_group(dim))" if "Mesh" in type(process_group).__name__ else ""
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, got "
                        f"{type(process_group).__name__}{hint}")
    if communicator is not None and not isinstance(communicator, Communicator):
        raise TypeError(f"communicator must be a comms.Communicator or None, got "
                        f"{type(communicator).__name__}")
    if communicator is not None and process_group is not None:
        raise ValueError("give either process_group or communicator, not both "
                         f"(got {process_group!r} and {communicator!r})")


def resolve_algorithm(compressor, algorithm, autotune, autotune_steps):
    """``(algorithm name, planner or None)`` for a DDP hook; raises naming a bad value."""
    if algorithm is not None and not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a str or None, got {algorithm!r}")
    if algorithm is None:
        algorithm = default_algorithm(compressor)
    planner = None
    alg = None if algorithm == "auto" else get_algorithm(algorithm)  # ValueError if unknown
    if alg is None or alg.hierarchical:
        # auto: the cost-model planner picks per bucket; hier_*: it supplies the topology
        from ..tuning.planner import Planner

        planner = Planner(compressor, probe=algorithm == "auto", autotune=autotune,
                          autotune_steps=autotune_steps)
    elif not isinstance(autotune, bool):
        raise TypeError(f"autotune must be True or False, got {autotune!r}")
    if alg is not None and not alg.supports(compressor):
        raise ValueError(f"algorithm {algorithm!r} needs the {alg.family!r} family, which "
                         f"{compressor.spec()!r} does not support (it supports "
                         f"{list(compressor.families)})")
    return algorithm, planner


class CompressionState(GradientState):
    """State of :func:`comms.ddp.hook.compression_hook`.

    Args:
        compressor: a :class:`compressors.Compressor` or a spec string (``"topk:density=0.01"``).
        process_group: the group to average over (``None``: WORLD); a
            ``torch.distributed.ProcessGroup`` (for a ``DeviceMesh`` pass
            ``mesh.get_group(dim)``). Not pickled.
        communicator: a :class:`~comms.transport.communicator.Communicator` to use instead of
            ``process_group`` (e.g. :class:`comms.cluster.mpi.MPICommunicator`).
        start_iter: iterations of plain allreduce before compressing. DDP rebuilds its
            buckets after iteration 0; residuals follow the layout (see the hook), so any
            value >= 0 is correct.
        algorithm: aggregation algorithm name, ``"auto"`` (the per-bucket cost-model planner
            with timed trials), or ``None`` for the compressor's cheapest supported family
            (allreduce, then allgather, then two_phase).
        min_compress_numel: buckets smaller than this go dense (latency dominates).
        autotune: with ``algorithm="auto"``: time the best few plans on real steps and lock in
            the fastest (:mod:`comms.tuning.autotune`); ``False``: the cost model's choice is final.
        autotune_steps: steps each rule runs per interleaved tuning round (>= 2).
        **options: the training options of :class:`~comms.core.options.PipelineOptions`
            (``error_feedback``, ``seed``, ``timeout``, ``momentum``, ``momentum_masking``,
            ``clip_norm``, ``residual_bound``, ``warmup_steps``), readable as attributes.

    Raises:
        ValueError / TypeError: any bad option, naming it — before any communication.

    Example::

        >>> state = CompressionState("qsgd:bits=4")
        >>> ddp_model.register_comm_hook(state, compression_hook)

    .. warning::
        Residuals and algorithm stores are per rank: checkpoint ``state_dict()`` on every
        rank, next to that rank's model and optimizer state.
    """

    __slots__ = (
        "process_group", "communicator", "iter", "algorithm", "planner", "router", "min_compress_numel",
        "dense_calls", "layout_tracker", "param_names", "config_check", "flags", "_warned_nonfinite", "outer",
        "auto_outer", "numel",
        "__weakref__",
    )

    _TRANSIENT = GradientState._TRANSIENT + ("process_group", "communicator", "config_check", "flags",
                                             "auto_outer")

    def __init__(self, compressor: "Compressor | str", process_group=None, *,
                 communicator: Communicator | None = None, start_iter: int = 2,
                 algorithm: str | None = None, min_compress_numel: int = 0, autotune: bool = True,
                 autotune_steps: int = 2, **options):
        super().__init__(PipelineOptions(compressor, start_iter=start_iter, **options))
        if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int):
            raise TypeError(f"min_compress_numel must be an int, got {min_compress_numel!r}")
        if min_compress_numel < 0:
            raise ValueError(f"min_compress_numel must be >= 0, got {min_compress_numel!r}")
        check_group(process_group, communicator)
        self.algorithm, self.planner = resolve_algorithm(self.compressor, algorithm, autotune,
                                                         autotune_steps)
        self.router = PlannerRouter(self.planner) if self.algorithm == "auto" else FixedRouter(self.algorithm)
        self.process_group = process_group
        self.communicator = communicator
        self.iter = 0
        self.min_compress_numel = min_compress_numel
        self.dense_calls = 0
        # the layout each bucket's residual and store belong to (persisted: resume maps DDP's
        # first-iteration buckets onto it)
        self.layout_tracker = LayoutTracker()
        self.param_names: dict[int, str] = {}  # data_ptr -> name, filled by bind()
        self._warned_nonfinite = False
        self.outer = None  # comms.outer.OuterSync with register(..., sync_every=H)
        # auto may switch to the outer sync (comms.ddp.outer_switch): (optimizer, parameters,
        # replica-check interval, momentum taken over) until decided; None: it will not
        self.auto_outer = None
        self.numel = 0  # the model's trainable elements (set by register)
        self._new_helpers()

    def _reset_transient(self) -> None:
        """Unpickled (like torch's PowerSGDState, without its process group)."""
        super()._reset_transient()
        self.process_group = self.communicator = None
        self._new_helpers()
        logger.warning("CompressionState unpickled without a process group: the default group is used")

    def _new_helpers(self) -> None:
        self.config_check = ConfigCheck(CONFIG_FIELDS)  # layouts whose config passed the check
        self.flags = StepFlags()  # this step's buckets awaiting the non-finite flag allreduce

    @property
    def layouts(self) -> dict[int, tuple]:
        """Bucket index -> parameter keys, in bucket order, of its residual's layout."""
        return self.layout_tracker.layouts

    # -- the one place that chooses algorithms -----------------------------------------
    def algorithm_for(self, bucket_index: int, numel: int, dtype: torch.dtype) -> str:
        """The algorithm for one bucket. A planner (``algorithm="auto"``) overrides this."""
        if self.algorithm == "auto":
            return self.planner.choose(bucket_index, numel, dtype)
        return self.algorithm

    def retune(self) -> None:
        """Autotune again from the next step (``algorithm="auto"``; call on every rank before
        the same step, e.g. after the links changed)."""
        if self.planner is None or self.algorithm != "auto":
            raise ValueError(f"retune() needs algorithm='auto', this state uses {self.algorithm!r}")
        self.planner.retune()

    @property
    def plan(self):
        """The auto planner's per-bucket decisions (``print(state.plan)``: bucket, bytes, chosen
        algorithm, predicted time of each candidate); ``None`` without a planner."""
        return None if self.planner is None else self.planner.plan

    def config_values(self, bucket_index: int, numel: int, dtype: torch.dtype, step: int) -> tuple:
        """The values of :data:`CONFIG_FIELDS` for one bucket (what all ranks must agree on)."""
        return (self.compressor.spec(), self.algorithm_for(bucket_index, numel, dtype), self.seed,
                self.start_iter, self.error_feedback, self.min_compress_numel, step, numel,
                str(dtype), self.momentum, self.momentum_masking, self.clip_norm,
                self.residual_bound, self.warmup_steps)

    # -- parameters and layouts --------------------------------------------------------
    def bind(self, model: torch.nn.Module) -> "CompressionState":
        """Name the model's parameters so bucket layouts survive a restart (``register`` calls it)."""
        module = getattr(model, "module", model)
        self.param_names = {p.data_ptr(): name for name, p in module.named_parameters()}
        return self

    def param_key(self, p: torch.Tensor):
        name = self.param_names.get(p.data_ptr())
        if name is not None:
            return name
        return f"{tuple(p.shape)}@{p.data_ptr()}"  # unnamed: valid in this process only

    # -- communication ------------------------------------------------------------------
    def comm(self) -> Communicator:
        if self.communicator is None:
            self.communicator = TorchCommunicator(self.process_group)
        c = self.communicator
        if self.timeout is not None and c.timeout != self.timeout:  # the user's bound wins
            c.timeout = self.timeout
            for tier in ("intra", "inter"):
                sub = getattr(c, tier, None)
                if sub is not None:
                    sub.timeout = self.timeout
        return c

    @property
    def nonfinite_buckets(self) -> int:
        """How many (bucket, step) reductions were non-finite and NaN-filled."""
        return self.nonfinite_calls

    # -- reporting -----------------------------------------------------------------------
    def report(self) -> str:
        """A table of the per-bucket statistics (bytes sent per rank per step)."""
        rows = stats_rows(self.stats, "bucket", str)
        rows.append(f"compressor={self.compressor.spec()} iter={self.iter} "
                    f"wire/step={self.wire_bytes_per_step()} dense/step={self.dense_bytes_per_step()}"
                    + (f" nonfinite_buckets={self.nonfinite_buckets}" if self.nonfinite_buckets else "")
                    + (f" layout resets={self.memory.layout_resets}" if self.memory.layout_resets else ""))
        tuner = self.planner.tuner if self.planner is not None else None
        if tuner is not None and tuner.locked:
            rows.append(f"autotune: locked {tuner.decision!r} after {tuner.tuning_steps} tuning steps, "
                        f"{tuner.tuning_cost_s * 1e3:.0f} ms beyond the locked plan; "
                        f"tunings {tuner.tunings}")
        return "\n".join(rows)

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers (``torch.load(weights_only=True)`` can read it).

        Holds the iteration counter, residuals, momentum-correction velocities, every
        algorithm store, the bucket layouts and the options they were made with.
        Residuals are per rank: save one file per rank.

        Example::

            >>> torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
            ...             "comm": state.state_dict()}, f"ckpt.rank{rank}.pt")
        """
        return {
            "iter": self.iter,
            **owner(),  # the rank that saved it: load_state_dict refuses it on another
            **self.options.as_dict(),
            "algorithm": self.algorithm,
            "memory": self.memory.state_dict(),
            "algo_store": {int(b): plain(d, f"algo_store[{b}]") for b, d in self.algo_store.items()},
            "layouts": {int(b): [str(k) for k in lay] for b, lay in self.layouts.items()},
            "nonfinite_buckets": self.nonfinite_buckets,
            # the auto planner's locked plan: a resumed run does not re-tune
            "planner": self.planner.state_dict() if self.algorithm == "auto" else None,
            # Adam's momentum space: when the variance froze (the momentum itself is the
            # optimizer's exp_avg, in the optimizer's state_dict)
            "adam": None if self.adam is None else self.adam.state_dict(),
            "outer": None if self.outer is None else self.outer.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any], device=None) -> None:
        """Restore :meth:`state_dict` (this rank's own file). Validates before changing anything.

        Raises:
            ValueError: saved by another rank or world size; saved with a different compressor,
                algorithm, momentum, momentum_masking, clip_norm, residual_bound or
                warmup_steps (the last only while either warm-up is not over at the saved step).
        """
        if not isinstance(sd, dict) or "iter" not in sd:
            raise TypeError(f"load_state_dict needs a dict from CompressionState.state_dict(), got "
                            f"{type(sd).__name__}")
        check_owner(sd)
        self.options.check_saved(sd, int(sd["iter"]))
        if (self.outer is None) != (sd.get("outer") is None):
            raise ValueError("state was saved " + ("with" if sd.get("outer") is not None else "without")
                             + " sync_every, this run " + ("uses it" if self.outer is not None else "does not"))
        if self.outer is not None:
            self.outer.load_state_dict(sd["outer"])  # validates before changing anything
        if sd.get("algorithm", self.algorithm) != self.algorithm:
            raise ValueError(f"state was saved with algorithm {sd['algorithm']!r}, "
                             f"this run uses {self.algorithm!r}")
        if self.algorithm == "auto" and sd.get("planner") is not None:
            self.planner.load_state_dict(sd["planner"])  # validates before changing anything
        self.iter = int(sd["iter"])
        self.seed = int(sd.get("seed", self.seed))
        self.memory.load_state_dict(sd.get("memory", {}), device=device)
        self.algo_store = {int(b): to_device(d, device) for b, d in sd.get("algo_store", {}).items()}
        self.layout_tracker = LayoutTracker()
        self.layout_tracker.layouts = {int(b): tuple(lay) for b, lay in sd.get("layouts", {}).items()}
        self.layout_tracker.restored = True
        self._nonfinite = int(sd.get("nonfinite_buckets", 0))
        if self.adam is not None and sd.get("adam") is not None:
            self.adam.load_state_dict(sd["adam"])
        self._new_helpers()
        settle(self)
