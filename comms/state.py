"""``CompressionState``: everything the compression hook keeps between calls."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from compressors import Compressor, ErrorFeedback, from_spec

from .algorithms import ALGORITHMS, get_algorithm
from .communicator import Communicator, TorchCommunicator

__all__ = ["CompressionState", "BucketStats"]

logger = logging.getLogger(__name__)

_PREFERENCE = ("allreduce", "allgather", "two_phase")


class BucketStats:
    """Per-bucket accounting of the last compressed call."""

    __slots__ = ("bucket", "numel", "dtype", "algorithm", "dense_bytes", "wire_bytes", "calls")

    def __init__(self, bucket, numel, dtype, algorithm, dense_bytes, wire_bytes):
        self.bucket, self.numel, self.dtype = bucket, numel, dtype
        self.algorithm, self.dense_bytes, self.wire_bytes = algorithm, dense_bytes, wire_bytes
        self.calls = 0

    @property
    def ratio(self) -> float:
        return self.dense_bytes / self.wire_bytes if self.wire_bytes else float("inf")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__} | {"ratio": self.ratio}


class CompressionState:
    """State of :func:`comms.hook.compression_hook`.

    Args:
        compressor: a :class:`compressors.Compressor` or a spec string (``"topk:density=0.01"``).
        process_group: the group to average over (``None``: WORLD). Not pickled.
        communicator: a :class:`~comms.communicator.Communicator` to use instead of
            ``process_group`` (e.g. :class:`comms.mpi.MPICommunicator`).
        error_feedback: keep per-bucket residuals. ``None`` (default) turns it on for biased
            compressors (top-k, random-k, sign, casts) and off for unbiased ones (QSGD): error
            feedback needs a contractive compressor, and low-bit stochastic quantization with
            max-abs scales is not one — its residual grows without bound.
        start_iter: iterations of plain allreduce before compressing. DDP rebuilds its
            buckets after iteration 0, so compression starts at iteration >= 1; 2 is safe.
        algorithm: aggregation algorithm name, or ``None`` for the compressor's cheapest
            supported family (allreduce, then allgather, then two_phase).
        seed: shared seed of the hash RNG streams (must match on all ranks).
        min_compress_numel: buckets smaller than this go dense (latency dominates).

    Example::

        >>> state = CompressionState("qsgd:bits=4")
        >>> ddp_model.register_comm_hook(state, compression_hook)
    """

    __slots__ = (
        "process_group", "communicator", "compressor", "error_feedback", "memory", "start_iter",
        "iter", "algorithm", "seed", "min_compress_numel", "stats", "algo_store",
        "dense_calls", "__weakref__",
    )

    def __init__(self, compressor: "Compressor | str", process_group=None, *,
                 communicator: Communicator | None = None, error_feedback: bool | None = None,
                 start_iter: int = 2, algorithm: str | None = None, seed: int = 0,
                 min_compress_numel: int = 0):
        self.compressor = from_spec(compressor)
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if algorithm is None:
            algorithm = next((a for a in _PREFERENCE if self.compressor.supports(a) and a in ALGORITHMS),
                             None)
            if algorithm is None:
                raise ValueError(f"compressor {self.compressor.spec()!r} supports none of the "
                                 f"available algorithms {sorted(ALGORITHMS)}")
        alg = get_algorithm(algorithm)
        if not self.compressor.supports(alg.family):
            raise ValueError(f"algorithm {algorithm!r} needs the {alg.family!r} family, which "
                             f"{self.compressor.spec()!r} does not support (it supports "
                             f"{list(self.compressor.families)})")
        self.process_group = process_group
        self.communicator = communicator
        if error_feedback is None:
            error_feedback = not self.compressor.unbiased
        elif not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True, False or None, got {error_feedback!r}")
        self.error_feedback = error_feedback
        self.memory = ErrorFeedback()
        self.start_iter = start_iter
        self.iter = 0
        self.algorithm = algorithm
        self.seed = seed
        self.min_compress_numel = int(min_compress_numel)
        self.stats: dict[int, BucketStats] = {}
        self.algo_store: dict[int, dict] = {}
        self.dense_calls = 0

    # -- communication ------------------------------------------------------------------
    def comm(self) -> Communicator:
        if self.communicator is None:
            self.communicator = TorchCommunicator(self.process_group)
        return self.communicator

    def store(self, bucket: int) -> dict:
        return self.algo_store.setdefault(bucket, {})

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
                    f"wire/step={self.wire_bytes_per_step()} dense/step={self.dense_bytes_per_step()}")
        return "\n".join(rows)

    # -- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers (``torch.load(weights_only=True)`` can read it).

        Residuals are per rank: save one file per rank.
        """
        store = {int(b): {k: v.detach().cpu().clone() for k, v in d.items() if isinstance(v, torch.Tensor)}
                 for b, d in self.algo_store.items()}
        return {
            "iter": self.iter,
            "seed": self.seed,
            "compressor": self.compressor.spec(),
            "algorithm": self.algorithm,
            "memory": self.memory.state_dict(),
            "algo_store": store,
        }

    def load_state_dict(self, sd: dict[str, Any], device=None) -> None:
        if sd.get("compressor", self.compressor.spec()) != self.compressor.spec():
            raise ValueError(f"state was saved with compressor {sd['compressor']!r}, "
                             f"this hook uses {self.compressor.spec()!r}")
        self.iter = int(sd["iter"])
        self.seed = int(sd.get("seed", self.seed))
        self.memory.load_state_dict(sd.get("memory", {}), device=device)
        self.algo_store = {int(b): {k: v.to(device) if device is not None else v for k, v in d.items()}
                           for b, d in sd.get("algo_store", {}).items()}

    def __getstate__(self):
        # like torch's PowerSGDState: process groups and communicators do not pickle
        return {k: getattr(self, k) for k in self.__slots__
                if k not in ("process_group", "communicator", "__weakref__")}

    def __setstate__(self, st):
        self.process_group = None
        self.communicator = None
        for k, v in st.items():
            setattr(self, k, v)
        logger.warning("CompressionState unpickled without a process group: the default group is used")
