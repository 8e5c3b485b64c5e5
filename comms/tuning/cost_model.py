"""Cost model: predicted time of every way to move one bucket (pure arithmetic).

Per tier (``flat``: the whole group; ``intra``: a node; ``inter``: one rank per node) a
latency ``alpha`` (seconds per collective) and a link bandwidth ``beta`` (bytes/s):

* ring allreduce of ``B`` bytes on ``n`` ranks: ``alpha + 2 (n-1)/n * B / beta``
* allgather of ``B`` bytes per rank:             ``alpha + (n-1) * B / beta``
* reduce-scatter / all-to-all of ``B`` bytes:    ``alpha + (n-1)/n * B / beta``

plus the compute of each compressor (``fixed + per_element * n`` for compress and for
decompress) and the hook's own local passes. Each algorithm owns its formula
(``Algorithm.cost``) and the list of collectives it issues (``Algorithm.wire_ops``); this
module only holds the numbers and loops over the registry. The numbers are measured by
:mod:`comms.tuning.probe` (collective; identical on every rank, so every rank makes the same plan).

Example::

    >>> model = probe(topology.communicator(), compressors=[comp])   # comms.tuning.probe, collective
    >>> model.predict("hier_allreduce", comp, numel=25_000_000)
    0.21
    >>> model.candidates(comp, 25_000_000, ["allreduce", "hier_allreduce"])
    {'dense': 0.98, 'allreduce': 0.52, 'hier_allreduce': 0.21}
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Iterable

import torch

from compressors import Compressor

from ..algorithms import ALGORITHMS, DENSE

__all__ = ["TierCost", "ComputeCost", "CostModel", "HOOK_PASSES"]

logger = logging.getLogger(__name__)

# local passes over the whole bucket that a compressed bucket pays and dense does not (the
# hook's error-feedback add and update, the non-finite check, the copy of the result)
HOOK_PASSES = 4


@dataclass(frozen=True)
class TierCost:
    """``alpha`` (s per collective) and ``beta`` (bytes/s per ring link) of one tier.

    ``betas`` holds the bandwidth measured for one collective on one wire dtype at a
    bucket-like size (``{("allreduce", "torch.float16"): bytes/s, ...}``, see
    :meth:`CostModel.refine`): gloo's fp16/bf16 sums on CPU are several times slower per
    byte than its fp32 sum, and an allgather of bytes is not an allreduce. Pairs that were
    not measured use ``beta``.
    """

    name: str
    world: int
    alpha: float
    beta: float
    betas: dict = field(default_factory=dict, compare=False)

    def beta_for(self, op: str, dtype=None) -> float:
        if dtype is None or not self.betas:
            return self.beta
        return self.betas.get((op, str(dtype)), self.beta)

    def _f(self, nbytes: float, factor: float, op: str = "allreduce", dtype=None) -> float:
        if self.world <= 1:
            return 0.0
        return self.alpha + factor * nbytes / self.beta_for(op, dtype)

    def allreduce(self, nbytes: float, dtype=None) -> float:
        n = self.world
        return self._f(nbytes, 2 * (n - 1) / n, "allreduce", dtype)

    def allgather(self, nbytes_per_rank: float, dtype=None) -> float:
        return self._f(nbytes_per_rank, self.world - 1, "allgather", dtype)

    def reduce_scatter(self, nbytes: float, dtype=None) -> float:
        n = self.world
        return self._f(nbytes, (n - 1) / n, "all_to_all", dtype)

    all_to_all = reduce_scatter

    @staticmethod
    def factor(op: str, world: int) -> float:
        """Link bytes per payload byte of ``op`` on a ring of ``world`` ranks."""
        if op == "allreduce":
            return 2 * (world - 1) / world
        if op == "allgather":
            return float(world - 1)
        return (world - 1) / world  # all_to_all / reduce-scatter

    @staticmethod
    def hops(op: str, world: int) -> int:
        """Ring steps of ``op`` on ``world`` ranks (each pays the link latency once)."""
        return 2 * (world - 1) if op == "allreduce" else world - 1

    def with_betas(self, betas: dict) -> "TierCost":
        return TierCost(self.name, self.world, self.alpha, self.beta, {**self.betas, **betas})

    @classmethod
    def fit(cls, name: str, world: int, sizes, times) -> "TierCost":
        """Fit ``alpha``, ``beta`` of the allreduce formula through two (bytes, seconds) points."""
        (s1, s2), (t1, t2) = sizes, times
        factor = 2 * (world - 1) / world if world > 1 else 1.0
        slope = (t2 - t1) / ((s2 - s1) * factor)  # seconds per link byte
        slope = max(slope, 1e-12)  # noise can make the big op look free; never infinite beta
        alpha = max(0.0, t1 - factor * s1 * slope)
        return cls(name, world, alpha, 1.0 / slope)


@dataclass(frozen=True)
class ComputeCost:
    """Compress / decompress time of one compressor: ``fixed + per_element * numel`` seconds."""

    compress_fixed: float = 0.0
    compress_per_element: float = 0.0
    decompress_fixed: float = 0.0
    decompress_per_element: float = 0.0

    def compress(self, numel: float) -> float:
        return self.compress_fixed + self.compress_per_element * numel

    def decompress(self, numel: float) -> float:
        return self.decompress_fixed + self.decompress_per_element * numel


@dataclass
class CostModel:
    """Measured tiers and compute costs; predicts candidate times for a bucket.

    Args:
        tiers: ``{"flat": TierCost, "intra": TierCost, "inter": TierCost}`` (the last two
            only for a hierarchical topology).
        compute: compressor spec -> :class:`ComputeCost`.
        local_size: ranks per node (hierarchical shard count).
        mem_per_element: seconds per element of one local elementwise pass (``c = a + b``)
            over a bucket-sized fp32 buffer; compressed candidates pay :data:`HOOK_PASSES` of
            them, hierarchical ones their own on top (0: not measured).
    """

    tiers: dict[str, TierCost]
    compute: dict[str, ComputeCost] = field(default_factory=dict)
    local_size: int = 1
    mem_per_element: float = 0.0

    # -- what one bucket issues -------------------------------------------------------------
    def compute_for(self, compressor: Compressor | None) -> ComputeCost:
        if compressor is None:
            return ComputeCost()
        return self.compute.get(compressor.spec(), ComputeCost())

    def wire_ops(self, algorithm: str, compressor: Compressor | None, numel: int,
                 dtype=torch.float32) -> list[tuple[str, str, str, int]]:
        """``[(tier, op, wire dtype name, bytes)]``: the collectives one bucket issues."""
        if algorithm == DENSE:
            return [("flat", "allreduce", str(dtype), numel * _itemsize(dtype))]
        alg = ALGORITHMS.get(algorithm)
        if alg is None or compressor is None or not alg.supports(compressor):
            return []
        if not alg.hierarchical and self.tiers["flat"].world <= 1:
            return []
        return alg.wire_ops(self, compressor, numel, dtype)

    # -- prediction ---------------------------------------------------------------------
    def dense(self, numel: int, dtype=torch.float32, tier: str = "flat") -> float:
        return self.tiers[tier].allreduce(numel * _itemsize(dtype), dtype)

    def predict(self, algorithm: str, compressor: Compressor | None, numel: int,
                dtype=torch.float32) -> float:
        """Predicted seconds for one bucket: ``"dense"`` or a registered algorithm's name."""
        if algorithm == DENSE:
            return self.dense(numel, dtype)
        alg = ALGORITHMS.get(algorithm)
        if alg is None:
            return math.inf  # unknown: never chosen over a predictable candidate
        return alg.cost(self, compressor, numel, dtype) + HOOK_PASSES * self.mem_per_element * numel

    def codec_seconds(self, algorithm: str, compressor: Compressor | None, numel: int,
                      dtype=torch.float32) -> float:
        """The local share of :meth:`predict`: ``algorithm``'s cost for one bucket with its
        collectives free (no latency, no link time) — its encodes, decodes and sums and the
        tiers' local passes, from the measured compute costs (0 for dense). What tells apart
        plans that move the same bytes: at 2 ranks qsgd8's allgather adds two decoded payloads
        where shared_scale decodes one sum."""
        alg = ALGORITHMS.get(algorithm) if algorithm != DENSE else None
        if alg is None or compressor is None:
            return 0.0
        free = {name: TierCost(name, t.world, 0.0, math.inf) for name, t in self.tiers.items()}
        return alg.cost(CostModel(free, self.compute, self.local_size, self.mem_per_element),
                        compressor, numel, dtype)

    def candidates(self, compressor: Compressor, numel: int, dtype=torch.float32,
                   algorithms: Iterable[str] = ()) -> dict[str, float]:
        """``{"dense": t, alg: t, ...}`` for ``dense`` and each named algorithm."""
        out = {"dense": self.dense(numel, dtype)}
        for a in algorithms:
            out[a] = self.predict(a, compressor, numel, dtype)
        return out

    def __str__(self) -> str:
        def betas(t):
            if not t.betas:
                return ""
            return " [" + ", ".join(f"{op}/{dt.replace('torch.', '')} {b / 1e9:.3f}"
                                    for (op, dt), b in sorted(t.betas.items())) + " GB/s]"

        tiers = ", ".join(f"{t.name}(n={t.world}, alpha={t.alpha * 1e3:.2f} ms, beta={t.beta / 1e9:.3f} GB/s"
                          f"{betas(t)})" for t in self.tiers.values())
        comp = ", ".join(f"{k}({v.compress_per_element * 1e9:.2f}+{v.decompress_per_element * 1e9:.2f} ns/el)"
                         for k, v in self.compute.items())
        mem = f"; local pass {self.mem_per_element * 1e9:.2f} ns/el" if self.mem_per_element else ""
        return f"CostModel[{tiers}; compute: {comp or '-'}{mem}]"


def _itemsize(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


