"""``CompressionState``: everything the compression hook keeps between calls.

What is persisted by :meth:`CompressionState.state_dict` (all plain tensors and numbers,
readable with ``torch.load(weights_only=True)``): the iteration counter, the error-feedback
residuals, every algorithm's per-bucket store (``state.algo_store``: two-phase owner
residuals, PowerSGD P/Q, ...), the bucket layouts the residuals belong to, and the
configuration they were made with. Residuals and stores are **per rank**: save one file per
rank and load each rank's own file.

Contract for algorithm authors: ``store`` dicts hold tensors, numbers, strings, ``None`` and
lists/tuples/dicts of those — anything else makes ``state_dict()`` raise ``TypeError``.

Why one module of ~350 lines: the option validation, the persisted fields and their
``state_dict``/``load_state_dict``/pickling must change together (a field added in one and
missed in another breaks resume); the hook's transient helpers live in their own modules
(config_check, step_flags, layouts, stats).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist

from compressors import Compressor, ErrorFeedback, from_spec

from .algorithms import ALGORITHMS, get_algorithm
from .communicator import Communicator, TorchCommunicator
from .config_check import ConfigCheck
from .deadline import check_timeout
from .layouts import LayoutTracker
from .stats import BucketStats
from .step_flags import StepFlags

__all__ = ["CompressionState", "BucketStats", "CONFIG_FIELDS"]

logger = logging.getLogger(__name__)

_PREFERENCE = ("allreduce", "allgather", "two_phase")

# what every rank must agree on for a bucket, in the order of the cross-rank config check
CONFIG_FIELDS = ("compressor", "algorithm", "seed", "start_iter", "error_feedback",
                 "min_compress_numel", "step", "numel", "dtype", "momentum", "momentum_masking",
                 "clip_norm", "residual_bound", "warmup_steps")


def _check_momentum(momentum):
    if momentum is None:
        return None
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
        raise TypeError(f"momentum must be a number in [0, 1) or None, got {momentum!r}")
    if not (0.0 <= float(momentum) < 1.0):
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    return float(momentum)


MASKING_MODES = ("held", "sent", "off")


def _check_masking(momentum_masking) -> str:
    """``momentum_masking`` as one of :data:`MASKING_MODES` (``True``: ``"sent"``, DGC's rule;
    ``False``: ``"off"``)."""
    if momentum_masking is True or momentum_masking is False:
        return "sent" if momentum_masking else "off"
    if isinstance(momentum_masking, str) and momentum_masking in MASKING_MODES:
        return momentum_masking
    raise TypeError(f"momentum_masking must be one of {MASKING_MODES} or a bool, got "
                    f"{momentum_masking!r}")


def _check_clip(clip_norm):
    if clip_norm is None:
        return None
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)):
        raise TypeError(f"clip_norm must be a positive number or None, got {clip_norm!r}")
    if not (float(clip_norm) > 0.0 and float(clip_norm) < float("inf")):
        raise ValueError(f"clip_norm must be a finite number > 0, got {clip_norm!r}")
    return float(clip_norm)


def _hash64(value) -> int:
    """A process-independent signed 64-bit hash (Python's ``hash`` of str is salted per process)."""
    h = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


def _plain(value, where: str):
    """Deep copy of ``value`` into what ``torch.load(weights_only=True)`` reads back."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"{where} holds a {type(value).__name__}, which a weights_only checkpoint "
                    "cannot hold; algorithm stores may keep tensors, numbers, str and containers")


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device) if device is not None else value.clone()
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


class CompressionState:
    """State of :func:`comms.hook.compression_hook`.

    Args:
        compressor: a :class:`compressors.Compressor` or a spec string (``"topk:density=0.01"``).
        process_group: the group to average over (``None``: WORLD); a
            ``torch.distributed.ProcessGroup`` (for a ``DeviceMesh`` pass
            ``mesh.get_group(dim)``). Not pickled.
        communicator: a :class:`~comms.communicator.Communicator` to use instead of
            ``process_group`` (e.g. :class:`comms.mpi.MPICommunicator`).
        error_feedback: keep per-bucket residuals. ``None`` (default) turns it on for biased
            compressors (top-k, random-k, sign, casts) and off for unbiased ones (QSGD): error
            feedback needs a contractive compressor, and low-bit stochastic quantization with
            max-abs scales is not one — its residual grows without bound.
        start_iter: iterations of plain allreduce before compressing. DDP rebuilds its
            buckets after iteration 0; residuals follow the layout (see the hook), so any
            value >= 0 is correct.
        algorithm: aggregation algorithm name, or ``None`` for the compressor's cheapest
            supported family (allreduce, then allgather, then two_phase). Per-bucket choice
            goes through :meth:`algorithm_for`.
        seed: shared seed of the hash RNG streams (must match on all ranks).
        min_compress_numel: buckets smaller than this go dense (latency dominates).
        autotune: with ``algorithm="auto"``: time the best few plans on real steps and lock in
            the fastest (:mod:`comms.autotune`); ``False``: the cost model's choice is final.
        autotune_steps: steps each rule runs per interleaved tuning round (>= 2; in the first
            round the first is not counted). Tuning takes at most 40 steps (``state.planner.tuner.max_steps``).
        timeout: seconds (or a ``timedelta``) any commpress wait may last before it raises
            ``comms.CollectiveTimeout`` (a stuck or dead peer); ``None``: the process group's
            timeout (``init_process_group(timeout=...)``). Local: may differ between ranks.
        momentum: Deep Gradient Compression's momentum correction (Lin et al., ICLR'18): the
            hook keeps each rank's SGD velocity ``u <- momentum * u + g`` per bucket and
            compresses ``u`` (plus the error-feedback residual), so what error feedback delays
            is the velocity itself and is not amplified again by an optimizer's momentum. The
            optimizer **must then run with momentum 0** (same ``lr``; the pairing is checked by
            :func:`comms.check_optimizer` and by ``register(..., optimizer=opt)``, which takes
            the momentum over from ``opt``). With a lossless compressor this is exactly SGD with
            momentum (dampening 0, no Nesterov). ``None`` (default): off — then an optimizer's
            momentum meets error feedback, which diverges for aggressive biased compressors
            (README, Convergence).
        momentum_masking: with ``momentum`` and a sparsifier (top-k, random-k), where to zero
            the velocity (momentum factor masking; compressors that send every coordinate,
            sign and QSGD, are never masked). ``"held"`` (default): where this rank sent a
            value that the aggregate held back — an algorithm that compresses again after
            the sum (``two_phase``'s owner) keeps it in a residual of its own, and momentum
            pushing on while that mass waits is what made top-k two_phase diverge with
            masking off. With ``allgather`` and ``allreduce`` every sent value lands in the
            same step's aggregate, so nothing is masked there: the momentum of a sent
            coordinate goes on exactly as SGD's would. The hierarchical forms mask nothing
            either (their compression error is the shard's residual, and the hook does not
            see what crossed the inter-node link). ``"sent"`` (or ``True``): wherever a value
            was sent (DGC's rule; it drops the momentum tail of every sent coordinate — top-k
            on the digits MLP: README, Convergence; with a hierarchical form, where a rank's
            own contribution is dense, it zeroes nearly all of the velocity). ``"off"`` (or
            ``False``): never.
        clip_norm: local gradient clipping (DGC): each rank scales its share of every bucket
            so that the bucket's L2 norm is at most ``clip_norm / world`` before momentum and
            error feedback, i.e. the averaged bucket gradient has norm <= ``clip_norm``. Per
            bucket (the hook sees one bucket at a time), private arithmetic before the
            collective, no host sync. ``None``: off. The threshold carries the model's gradient
            scale, so there is no default: one below a bucket's typical norm clips it on every
            step, which is normalized SGD there (a smaller step, for dense as well; top-k on the
            momentum task: bench/results/convergence_topk_clip_s25.md). It costs a norm and a
            scaling pass per bucket, and the error-feedback update runs unfused.
        residual_bound: bound the error-feedback input ``x + r`` to ``residual_bound * |x|``
            (L2, per bucket; ``x`` the fresh gradient or velocity), dropping the mass beyond it.
            Random-k's residual holds ~``1/density`` steps of velocity that leave together — a
            step ``1/density`` times too late, which SGD momentum 0.9 at lr 0.05 turns into
            divergence (bench/results/convergence.md, momentum task); the bound keeps it a
            bounded multiple of the fresh update. ``"auto"`` (default): the compressor's
            ``default_residual_bound`` (5 for random-k, none for the others); ``None``: off.
        warmup_steps: DGC's warm-up: the first ``warmup_steps`` steps from ``start_iter``
            (an autotune trial's dense steps among them) use milder variants of the
            compressor, ramping to it
            (``Compressor.warmup``: top-k/random-k density ``density ** ((k + 1) / (W + 1))``
            at compressed step ``k`` — 1% over 5 steps: 46%, 22%, 10%, 4.6%, 2.2%, then 1%;
            QSGD 8 bits for the first half; sign unchanged). A step whose variant keeps more
            than 15% of the elements or would send more than half a dense step's bytes sends
            the bucket dense, residual included (top-k's default ramp: dense, dense, 10%,
            4.6%, 2.2% at 2-4 ranks). The autotuner counts no step of the ramp.
            ``"auto"`` (default): the compressor's ``default_warmup_steps`` (5 for top-k,
            0 — off — for the others); 0: off. Random-k's ramp (opt-in) diverged on 2 of 4
            seeds of the momentum task (bench/results/convergence_topk_warmup5_s22.md).

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
        "process_group", "communicator", "compressor", "error_feedback", "memory", "start_iter",
        "iter", "algorithm", "planner", "seed", "min_compress_numel", "stats", "algo_store",
        "dense_calls", "layout_tracker", "param_names", "nonfinite_buckets", "config_check",
        "flags", "_warned_nonfinite", "replica_guard", "timeout", "momentum", "momentum_masking",
        "clip_norm", "residual_bound", "warmup_steps", "_warm", "__weakref__",
    )

    _TRANSIENT = ("process_group", "communicator", "config_check", "flags", "replica_guard",
                  "_warm", "__weakref__")

    def __init__(self, compressor: "Compressor | str", process_group=None, *,
                 communicator: Communicator | None = None, error_feedback: bool | None = None,
                 start_iter: int = 2, algorithm: str | None = None, seed: int = 0,
                 min_compress_numel: int = 0, autotune: bool = True, autotune_steps: int = 2,
                 timeout=None, momentum: float | None = None, momentum_masking: "str | bool" = "held",
                 clip_norm: float | None = None, residual_bound: "float | str | None" = "auto",
                 warmup_steps: "int | str" = "auto"):
        if not isinstance(compressor, (str, Compressor)):
            raise TypeError(f"compressor must be a spec string or a compressors.Compressor, "
                            f"got {compressor!r}")
        self.compressor = from_spec(compressor)
        # seconds any wait of commpress may last (None: the process group's timeout)
        self.timeout = check_timeout(timeout)
        if isinstance(start_iter, bool) or not isinstance(start_iter, int):
            raise TypeError(f"start_iter must be an int, got {start_iter!r}")
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int):
            raise TypeError(f"min_compress_numel must be an int, got {min_compress_numel!r}")
        if min_compress_numel < 0:
            raise ValueError(f"min_compress_numel must be >= 0, got {min_compress_numel!r}")
        momentum = _check_momentum(momentum)
        clip_norm = _check_clip(clip_norm)
        if warmup_steps == "auto":
            warmup_steps = getattr(self.compressor, "default_warmup_steps", 0)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be 'auto' or an int >= 0, got {warmup_steps!r}")
        if residual_bound == "auto":
            residual_bound = getattr(self.compressor, "default_residual_bound", None)
        if residual_bound is not None:
            if isinstance(residual_bound, bool) or not isinstance(residual_bound, (int, float)) \
                    or not (1.0 <= float(residual_bound) < float("inf")):
                raise ValueError(f"residual_bound must be 'auto', None or a finite number >= 1, "
                                 f"got {residual_bound!r}")
            residual_bound = float(residual_bound)
        momentum_masking = _check_masking(momentum_masking)
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
        if algorithm is not None and not isinstance(algorithm, str):
            raise TypeError(f"algorithm must be a str or None, got {algorithm!r}")
        if algorithm is None:
            algorithm = next((a for a in _PREFERENCE if self.compressor.supports(a) and a in ALGORITHMS),
                             None)
            if algorithm is None:
                raise ValueError(f"compressor {self.compressor.spec()!r} supports none of the "
                                 f"available algorithms {sorted(ALGORITHMS)}")
        self.planner = None
        alg = None if algorithm == "auto" else get_algorithm(algorithm)  # ValueError if unknown
        if alg is None or alg.hierarchical:
            # auto: the cost-model planner picks per bucket; hier_*: it supplies the topology
            from .planner import Planner

            self.planner = Planner(self.compressor, probe=algorithm == "auto", autotune=autotune,
                                   autotune_steps=autotune_steps)
        elif not isinstance(autotune, bool):
            raise TypeError(f"autotune must be True or False, got {autotune!r}")
        if alg is not None and not alg.supports(self.compressor):
            raise ValueError(f"algorithm {algorithm!r} needs the {alg.family!r} family, which "
                             f"{self.compressor.spec()!r} does not support (it supports "
                             f"{list(self.compressor.families)})")
        if error_feedback is None:
            error_feedback = not self.compressor.unbiased
        elif not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True, False or None, got {error_feedback!r}")
        self.process_group = process_group
        self.communicator = communicator
        self.error_feedback = error_feedback
        self.memory = ErrorFeedback()
        self.start_iter = start_iter
        self.iter = 0
        self.algorithm = algorithm
        self.seed = seed
        self.min_compress_numel = min_compress_numel
        self.stats: dict[int, BucketStats] = {}
        self.algo_store: dict[int, dict] = {}
        self.dense_calls = 0
        # the layout each bucket's residual and store belong to (persisted: resume maps DDP's
        # first-iteration buckets onto it)
        self.layout_tracker = LayoutTracker()
        self.param_names: dict[int, str] = {}  # data_ptr -> name, filled by bind()
        self.nonfinite_buckets = 0
        self._warned_nonfinite = False
        self.replica_guard = None    # comms.replicas.ReplicaGuard, set by register()
        self.momentum = momentum
        self.momentum_masking = momentum_masking
        self.clip_norm = clip_norm
        self.residual_bound = residual_bound
        self.warmup_steps = warmup_steps
        self._warm: dict = {}  # compressed step -> warm-up compressor (dropped after the ramp)
        self._reset_transient()

    def _reset_transient(self) -> None:
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

    def compressor_at(self, step: int):
        """The compressor for ``step``: a warm-up variant during the first ``warmup_steps``
        compressed steps, else ``self.compressor`` (every rank picks the same: ``step`` is
        shared)."""
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

    @property
    def local_transform(self) -> bool:
        """True when the hook changes each rank's gradient before the collective (momentum
        correction or clipping): then every bucket, the dense ones too, goes through it."""
        return self.momentum is not None or self.clip_norm is not None

    def config_hash(self, bucket_index: int, numel: int, dtype: torch.dtype, step: int) -> list[int]:
        """One process-independent int64 per config field."""
        return [_hash64(v) for v in self.config_values(bucket_index, numel, dtype, step)]

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

    def store(self, bucket: int) -> dict:
        return self.algo_store.setdefault(bucket, {})

    def reset_bucket(self, bucket: int) -> None:
        """Forget a bucket's residual, velocity and algorithm store (layout change, non-finite
        values)."""
        self.memory.reset(bucket)
        self.algo_store.pop(bucket, None)

    # -- reporting -----------------------------------------------------------------------
    def wire_bytes_per_step(self) -> int:
        return sum(s.wire_bytes for s in self.stats.values())

    def dense_bytes_per_step(self) -> int:
        return sum(s.dense_bytes for s in self.stats.values())

    def report(self) -> str:
        """A table of the per-bucket statistics (bytes sent per rank per step)."""
        rows = [f"{'bucket':>6} {'numel':>11} {'dtype':>9} {'algorithm':>10} {'dense B':>12} "
                f"{'wire B':>12} {'ratio':>7}"]
        for b in sorted(self.stats):
            s = self.stats[b]
            rows.append(f"{b:>6} {s.numel:>11} {str(s.dtype).replace('torch.', ''):>9} "
                        f"{s.algorithm:>10} {s.dense_bytes:>12} {s.wire_bytes:>12} {s.ratio:>7.1f}")
        rows.append(f"compressor={self.compressor.spec()} iter={self.iter} "
                    f"wire/step={self.wire_bytes_per_step()} dense/step={self.dense_bytes_per_step()}"
                    + (f" nonfinite_buckets={self.nonfinite_buckets}" if self.nonfinite_buckets else ""))
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
            "seed": self.seed,
            "start_iter": self.start_iter,
            "compressor": self.compressor.spec(),
            "algorithm": self.algorithm,
            "error_feedback": self.error_feedback,
            "momentum": self.momentum,
            "momentum_masking": self.momentum_masking,
            "clip_norm": self.clip_norm,
            "residual_bound": self.residual_bound,
            "warmup_steps": self.warmup_steps,
            "memory": self.memory.state_dict(),
            "algo_store": {int(b): _plain(d, f"algo_store[{b}]") for b, d in self.algo_store.items()},
            "layouts": {int(b): [str(k) for k in lay] for b, lay in self.layouts.items()},
            "nonfinite_buckets": self.nonfinite_buckets,
            # the auto planner's locked plan: a resumed run does not re-tune
            "planner": self.planner.state_dict() if self.algorithm == "auto" else None,
        }

    def load_state_dict(self, sd: dict[str, Any], device=None) -> None:
        """Restore :meth:`state_dict` (this rank's own file). Validates before changing anything.

        Raises:
            ValueError: saved with a different compressor, algorithm, momentum,
                momentum_masking, clip_norm, residual_bound or warmup_steps (the last only
                while either warm-up is not over at the saved step).
        """
        if not isinstance(sd, dict) or "iter" not in sd:
            raise TypeError(f"load_state_dict needs a dict from CompressionState.state_dict(), got "
                            f"{type(sd).__name__}")
        if sd.get("compressor", self.compressor.spec()) != self.compressor.spec():
            raise ValueError(f"state was saved with compressor {sd['compressor']!r}, "
                             f"this hook uses {self.compressor.spec()!r}")
        if sd.get("algorithm", self.algorithm) != self.algorithm:
            raise ValueError(f"state was saved with algorithm {sd['algorithm']!r}, "
                             f"this hook uses {self.algorithm!r}")
        saved = dict(sd)
        if "momentum_masking" in saved:  # a bool before "held" existed: True was "sent"
            saved["momentum_masking"] = _check_masking(saved["momentum_masking"])
        ramps_end = self.start_iter + max(int(saved.get("warmup_steps", 0)), self.warmup_steps)
        if int(sd["iter"]) >= ramps_end:
            # both ramps are over (e.g. a checkpoint from before top-k warmed up by default):
            # the count no longer changes any step
            saved.pop("warmup_steps", None)
        for key in ("momentum", "momentum_masking", "clip_norm", "residual_bound", "warmup_steps"):
            if saved.get(key, getattr(self, key)) != getattr(self, key):
                raise ValueError(f"state was saved with {key}={saved[key]!r}, this hook uses "
                                 f"{key}={getattr(self, key)!r}")
        if self.algorithm == "auto" and sd.get("planner") is not None:
            self.planner.load_state_dict(sd["planner"])  # validates before changing anything
        self.iter = int(sd["iter"])
        self.seed = int(sd.get("seed", self.seed))
        self.memory.load_state_dict(sd.get("memory", {}), device=device)
        self.algo_store = {int(b): _to_device(d, device) for b, d in sd.get("algo_store", {}).items()}
        self.layout_tracker = LayoutTracker()
        self.layout_tracker.layouts = {int(b): tuple(lay) for b, lay in sd.get("layouts", {}).items()}
        self.layout_tracker.restored = True
        self.nonfinite_buckets = int(sd.get("nonfinite_buckets", 0))
        self._reset_transient()

    def __getstate__(self):
        # like torch's PowerSGDState: process groups and communicators do not pickle
        return {k: getattr(self, k) for k in self.__slots__ if k not in self._TRANSIENT}

    def __setstate__(self, st):
        self.process_group = None
        self.communicator = None
        self.replica_guard = None
        self._warm = {}
        self._reset_transient()
        for k, v in st.items():
            setattr(self, k, v)
        logger.warning("CompressionState unpickled without a process group: the default group is used")
