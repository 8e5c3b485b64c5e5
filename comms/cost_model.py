"""Cost model: predicted time of every way to move one bucket, from measurements.

Per tier (``flat``: the whole group; ``intra``: a node; ``inter``: one rank per node) a
latency ``alpha`` (seconds per collective) and a link bandwidth ``beta`` (bytes/s) are fitted
from a short probe — a few allreduces of two sizes, run by every rank of every group of the
tier at once, so link sharing (two inter-node groups on one NIC) is in the numbers:

* ring allreduce of ``B`` bytes on ``n`` ranks: ``alpha + 2 (n-1)/n * B / beta``
* allgather of ``B`` bytes per rank:             ``alpha + (n-1) * B / beta``
* reduce-scatter / all-to-all of ``B`` bytes:    ``alpha + (n-1)/n * B / beta``

plus the measured compute of each compressor on this device (``fixed + per_element * n``
for compress and for decompress, timed on a sample). Every measurement is max-reduced over
all ranks before fitting, so every rank holds the same numbers and makes the *same* plan —
a plan that differed between ranks would mismatch collectives (hang) or diverge replicas.

Example::

    >>> model = CostModel.probe(topology.communicator(), compressors=[comp])   # collective
    >>> model.predict("hier_allreduce", comp, numel=25_000_000)
    0.21
    >>> model.candidates(comp, 25_000_000)
    {'dense': 0.98, 'allreduce': 0.52, 'hier_allreduce': 0.21, ...}
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from compressors import Compressor, Context

from .communicator import Communicator
from .futures import completed

__all__ = ["TierCost", "ComputeCost", "CostModel", "ALGORITHM_COSTS", "FAMILY_COSTS",
           "PROBE_SIZES", "LocalCommunicator"]

logger = logging.getLogger(__name__)

PROBE_SIZES = (16 << 10, 4 << 20)  # bytes: latency-bound and bandwidth-bound
SAMPLE_NUMELS = (1 << 12, 1 << 20)  # compressor timing sample sizes


@dataclass(frozen=True)
class TierCost:
    """``alpha`` (s per collective) and ``beta`` (bytes/s per ring link) of one tier."""

    name: str
    world: int
    alpha: float
    beta: float

    def _f(self, nbytes: float, factor: float) -> float:
        if self.world <= 1:
            return 0.0
        return self.alpha + factor * nbytes / self.beta

    def allreduce(self, nbytes: float) -> float:
        n = self.world
        return self._f(nbytes, 2 * (n - 1) / n)

    def allgather(self, nbytes_per_rank: float) -> float:
        return self._f(nbytes_per_rank, self.world - 1)

    def reduce_scatter(self, nbytes: float) -> float:
        n = self.world
        return self._f(nbytes, (n - 1) / n)

    all_to_all = reduce_scatter

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


class LocalCommunicator(Communicator):
    """A one-rank communicator (every collective is the identity): times compute alone."""

    backend, rank, world_size = "local", 0, 1

    def all_reduce(self, t):
        return completed(t)

    def all_gather(self, t):
        return completed(t.clone())

    def all_to_all(self, t):
        return completed(t.clone())

    def reduce_scatter(self, t):
        return completed(t.clone())

    def broadcast(self, t, src=0):
        return completed(t)


# -- per-algorithm formulas ------------------------------------------------------------
# f(tier, compressor, compute, numel, dtype) -> seconds, for the flat algorithm on ``tier``

def _t_allreduce(tier, comp, cc, numel, dtype):
    return cc.compress(numel) + tier.allreduce(comp.wire_bytes(numel, dtype)) + cc.decompress(numel)


def _t_allgather(tier, comp, cc, numel, dtype):
    # every rank decodes every payload
    return (cc.compress(numel) + tier.allgather(comp.wire_bytes(numel, dtype))
            + tier.world * cc.decompress(numel))


def _t_two_phase(tier, comp, cc, numel, dtype):
    n = tier.world
    m = -(-numel // n)
    wire = comp.wire_bytes(m, dtype)
    return (cc.compress(numel) + tier.all_to_all(n * wire) + n * cc.decompress(m)  # phase 1
            + cc.compress(m) + tier.allgather(wire) + n * cc.decompress(m))  # owner + phase 2


def _t_shared_scale(tier, comp, cc, numel, dtype):
    # a tiny allgather of per-chunk scales, then one integer allreduce; wire_bytes of the
    # algorithm already counts both, split them for the two latencies
    from .algorithms import get_algorithm

    alg = get_algorithm("shared_scale")
    n = tier.world
    total = alg.wire_bytes(comp, numel, dtype, n) if n > 1 else 0
    return cc.compress(numel) + 2 * tier.alpha * (n > 1) + total / tier.beta + cc.decompress(numel)


ALGORITHM_COSTS: dict[str, Callable] = {"allreduce": _t_allreduce, "allgather": _t_allgather,
                                        "two_phase": _t_two_phase, "shared_scale": _t_shared_scale}
FAMILY_COSTS: dict[str, Callable] = {"allreduce": _t_allreduce, "allgather": _t_allgather,
                                     "two_phase": _t_two_phase, "shared_scale": _t_shared_scale}


def _time(fn, reps: int) -> float:
    fn()  # warm: first touch, lazy init
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@dataclass
class CostModel:
    """Measured tiers and compute costs; predicts candidate times for a bucket.

    Args:
        tiers: ``{"flat": TierCost, "intra": TierCost, "inter": TierCost}`` (the last two
            only for a hierarchical topology).
        compute: compressor spec -> :class:`ComputeCost`.
        local_size: ranks per node (hierarchical shard count).
    """

    tiers: dict[str, TierCost]
    compute: dict[str, ComputeCost] = field(default_factory=dict)
    local_size: int = 1

    # -- measurement ------------------------------------------------------------------
    @classmethod
    def probe(cls, comm: Communicator, compressors: Iterable[Compressor] = (), *,
              sizes=PROBE_SIZES, reps: int = 3, sample_numels=SAMPLE_NUMELS) -> "CostModel":
        """Measure every tier of ``comm`` and every compressor; same result on all ranks.

        Collective over ``comm`` (and its ``intra``/``inter`` groups when it is a
        :class:`~comms.topology.TieredCommunicator`). Re-runnable (links change).
        """
        if len(sizes) != 2 or not 0 < sizes[0] < sizes[1]:
            raise ValueError(f"sizes must be two increasing byte counts, got {sizes!r}")
        tiers = {"flat": comm}
        intra, inter = getattr(comm, "intra", None), getattr(comm, "inter", None)
        if intra is not None and inter is not None:
            tiers["intra"], tiers["inter"] = intra, inter
        compressors = list(compressors)
        vec = []
        for name, c in tiers.items():
            for s in sizes:
                vec.append(_time_allreduce(comm, c, s, reps))
        for comp in compressors:
            vec += _time_compute(comp, sample_numels, reps)
        # one MAX over every rank: each rank then fits the same numbers
        t = torch.tensor(vec, dtype=torch.float64)
        t = _allreduce_max(comm, t)
        vals = t.tolist()
        fitted, i = {}, 0
        for name, c in tiers.items():
            fitted[name] = TierCost.fit(name, c.world_size, sizes, vals[i: i + 2])
            i += 2
        compute = {}
        (n1, n2) = sample_numels
        for comp in compressors:
            c1, c2, d1, d2 = vals[i: i + 4]
            i += 4
            if not all(map(math.isfinite, (c1, c2, d1, d2))):  # timing failed on some rank
                compute[comp.spec()] = ComputeCost(math.inf)
                continue
            cs, ds = max(0.0, (c2 - c1) / (n2 - n1)), max(0.0, (d2 - d1) / (n2 - n1))
            compute[comp.spec()] = ComputeCost(max(0.0, c1 - cs * n1), cs, max(0.0, d1 - ds * n1), ds)
        local_size = intra.world_size if "intra" in fitted else 1
        model = cls(fitted, compute, local_size)
        logger.info("cost model: %s", model)
        return model

    # -- prediction ---------------------------------------------------------------------
    def dense(self, numel: int, dtype=torch.float32, tier: str = "flat") -> float:
        return self.tiers[tier].allreduce(numel * _itemsize(dtype))

    def predict(self, algorithm: str, compressor: Compressor | None, numel: int,
                dtype=torch.float32) -> float:
        """Predicted seconds for one bucket: ``"dense"``, a flat algorithm, or ``hier_<alg>``."""
        if algorithm == "dense":
            return self.dense(numel, dtype)
        if algorithm.startswith("hier_"):
            if "inter" not in self.tiers:
                return math.inf
            inner = algorithm[len("hier_"):]
            L = self.local_size
            shard = -(-numel // L)
            es = _itemsize(dtype)
            intra = self.tiers["intra"]
            return (intra.all_to_all(L * shard * es) + self._flat(inner, "inter", compressor, shard, dtype)
                    + intra.allgather(shard * es))
        return self._flat(algorithm, "flat", compressor, numel, dtype)

    def _flat(self, algorithm, tier, compressor, numel, dtype):
        from .algorithms import ALGORITHMS

        fn = ALGORITHM_COSTS.get(algorithm)
        if fn is None:
            family = getattr(ALGORITHMS.get(algorithm), "family", None)
            fn = FAMILY_COSTS.get(family)
        if fn is None:
            return math.inf  # no formula: never chosen over a predictable candidate
        cc = self.compute.get(compressor.spec(), ComputeCost()) if compressor is not None else ComputeCost()
        return fn(self.tiers[tier], compressor, cc, numel, dtype)

    def candidates(self, compressor: Compressor, numel: int, dtype=torch.float32,
                   algorithms: Iterable[str] = ()) -> dict[str, float]:
        """``{"dense": t, alg: t, ...}`` for ``dense`` and each named algorithm."""
        out = {"dense": self.dense(numel, dtype)}
        for a in algorithms:
            out[a] = self.predict(a, compressor, numel, dtype)
        return out

    def __str__(self) -> str:
        tiers = ", ".join(f"{t.name}(n={t.world}, alpha={t.alpha * 1e3:.2f} ms, beta={t.beta / 1e9:.3f} GB/s)"
                          for t in self.tiers.values())
        comp = ", ".join(f"{k}({v.compress_per_element * 1e9:.2f}+{v.decompress_per_element * 1e9:.2f} ns/el)"
                         for k, v in self.compute.items())
        return f"CostModel[{tiers}; compute: {comp or '-'}]"


def _itemsize(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _allreduce_max(comm: Communicator, t: torch.Tensor) -> torch.Tensor:
    """MAX over ranks with the sum-only interface: allgather, then max in rank order."""
    g = comm.all_gather(t).wait()
    return g.view(comm.world_size, -1).amax(0)


def _time_allreduce(flat: Communicator, c: Communicator, nbytes: int, reps: int) -> float:
    """Seconds per allreduce of ``nbytes`` on ``c``, every group of the tier at once."""
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    c.all_reduce(buf).wait()  # warm: connections, first touch
    flat.all_reduce(torch.zeros(1)).wait()  # line every rank up before timing
    t0 = time.perf_counter()
    for _ in range(reps):
        c.all_reduce(buf).wait()
    return (time.perf_counter() - t0) / reps


def _time_compute(comp: Compressor, numels, reps: int) -> list[float]:
    """[compress(n1), compress(n2), decompress(n1), decompress(n2)] seconds on this device."""
    try:
        return _time_compute_unchecked(comp, numels, reps)
    except Exception:  # noqa: BLE001 - a rank must not skip the MAX that follows (hang)
        logger.warning("cost model: timing %s failed; it will not be planned", comp.spec(), exc_info=True)
        return [math.inf] * (2 * len(numels))


def _time_compute_unchecked(comp, numels, reps):
    g = torch.Generator().manual_seed(0)
    comp_t, dec_t = [], []
    for n in numels:
        x = torch.randn(n, generator=g)
        ctx = Context(numel=n, dtype=x.dtype, device=x.device)
        if hasattr(comp, "linear_aggregate"):  # multi-round linear compressors: time it whole
            local = LocalCommunicator()
            comp_t.append(_time(lambda: comp.linear_aggregate(local, x, ctx, {}).wait(), reps))
            dec_t.append(0.0)
            continue
        payload = comp.compress(x, ctx)
        comp_t.append(_time(lambda: comp.compress(x, ctx), reps))
        dec_t.append(_time(lambda: comp.decompress(payload, ctx), reps))
    return comp_t + dec_t
