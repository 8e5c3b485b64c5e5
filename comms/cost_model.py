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
           "PROBE_SIZES", "LocalCommunicator", "payload_dtype", "wire_ops", "HOOK_PASSES",
           "HIER_PASSES"]

logger = logging.getLogger(__name__)

# bytes: the small end of real buckets (smaller ones go dense) and a bandwidth-bound size. gloo
# takes other code paths for tiny messages (16 KiB over 4 ranks measured slower than 256 KiB
# on netsim), so a latency fitted there mis-predicts the bucket sizes that matter
PROBE_SIZES = (128 << 10, 4 << 20)
SAMPLE_NUMELS = (1 << 12, 1 << 20)  # compressor timing sample sizes
PROBE_CAP_BYTES = 8 << 20  # refine(): largest probe collective (~70 ms at 1 Gb/s)
COMPUTE_NUMEL = 1 << 22  # refine(): compute timed at up to 16 MB of fp32 (past the caches)
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                               torch.int8, torch.uint8, torch.int32, torch.int64)}


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
# f(tier, compressor, compute, numel, dtype) -> seconds, for the flat algorithm on ``tier``.
# Each collective is charged at the bandwidth measured for the dtype it really carries:
# the allreduce family sums the payload's dtype (fp16, int8, ...), gathers move bytes.

_PAYLOAD_DTYPES: dict[tuple, torch.dtype] = {}


def payload_dtype(comp: Compressor, dtype=torch.float32) -> torch.dtype:
    """The dtype the allreduce family sums for ``comp`` (one compress of a small sample;
    memoised). Multi-round linear compressors (PowerSGD) sum factors of the bucket dtype."""
    key = (comp.spec(), str(dtype))
    got = _PAYLOAD_DTYPES.get(key)
    if got is not None:
        return got
    got = dtype
    if not hasattr(comp, "linear_aggregate") and comp.supports("allreduce"):
        try:
            x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(dtype)
            kinds = {t.dtype for t in comp.compress(x, Context(numel=4096, dtype=dtype, device=x.device))}
            if len(kinds) == 1:
                got = kinds.pop()
        except Exception:  # noqa: BLE001 - a compressor that cannot compress here: bucket dtype
            logger.debug("payload dtype of %s unknown; assuming %s", comp.spec(), dtype, exc_info=True)
    _PAYLOAD_DTYPES[key] = got
    return got


def _t_allreduce(tier, comp, cc, numel, dtype):
    return (cc.compress(numel) + tier.allreduce(comp.wire_bytes(numel, dtype), payload_dtype(comp, dtype))
            + cc.decompress(numel))


def _t_allgather(tier, comp, cc, numel, dtype):
    # every rank decodes every payload
    return (cc.compress(numel) + tier.allgather(comp.wire_bytes(numel, dtype), torch.uint8)
            + tier.world * cc.decompress(numel))


def _t_two_phase(tier, comp, cc, numel, dtype):
    n = tier.world
    m = -(-numel // n)
    wire = comp.wire_bytes(m, dtype)
    return (cc.compress(numel) + tier.all_to_all(n * wire, torch.uint8) + n * cc.decompress(m)  # phase 1
            + cc.compress(m) + tier.allgather(wire, torch.uint8) + n * cc.decompress(m))  # owner + phase 2


def _t_shared_scale(tier, comp, cc, numel, dtype):
    # a tiny allgather of per-chunk scales, then one integer (int8/int32) allreduce
    n = tier.world
    if n <= 1:
        return cc.compress(numel) + cc.decompress(numel)
    from .algorithms.shared_scale import shared_scale_levels

    _, wire_dtype = shared_scale_levels(comp.bits, n)
    nch = -(-numel // comp.chunk)
    return (cc.compress(numel) + tier.allgather(4 * nch, torch.float32)
            + tier.allreduce(numel * wire_dtype.itemsize, wire_dtype) + cc.decompress(numel))


ALGORITHM_COSTS: dict[str, Callable] = {"allreduce": _t_allreduce, "allgather": _t_allgather,
                                        "two_phase": _t_two_phase, "shared_scale": _t_shared_scale}
FAMILY_COSTS: dict[str, Callable] = {"allreduce": _t_allreduce, "allgather": _t_allgather,
                                     "two_phase": _t_two_phase, "shared_scale": _t_shared_scale}

# local passes over the whole bucket that a compressed bucket pays and dense does not
# (the hook's error-feedback add and update, the non-finite check, the copy of the result),
# and the hierarchy's own (the node-local sum of the chunks, the copy for ``own``)
HOOK_PASSES = 4
HIER_PASSES = 2


def wire_ops(algorithm: str, comp: Compressor | None, numel: int, dtype, tiers: dict,
             local_size: int = 1, tier: str = "flat") -> list[tuple[str, str, str, int]]:
    """``[(tier, op, dtype name, bytes)]``: the collectives one bucket issues (what to probe)."""
    from .algorithms import ALGORITHMS

    es = _itemsize(dtype)
    if algorithm == "dense":
        return [("flat", "allreduce", str(dtype), numel * es)]
    if algorithm.startswith("hier_"):
        if "inter" not in tiers:
            return []
        shard = -(-numel // local_size)
        inner = wire_ops(algorithm[len("hier_"):], comp, shard, dtype, tiers, local_size, "inter")
        return ([("intra", "all_to_all", str(dtype), local_size * shard * es)] + inner
                + [("intra", "allgather", str(dtype), shard * es)])
    family = algorithm if algorithm in FAMILY_COSTS else getattr(ALGORITHMS.get(algorithm), "family", None)
    n = tiers[tier].world if tier in tiers else 1
    u8 = str(torch.uint8)
    if comp is None or n <= 1:
        return []
    if family == "allreduce":
        return [(tier, "allreduce", str(payload_dtype(comp, dtype)), comp.wire_bytes(numel, dtype))]
    if family == "allgather":
        return [(tier, "allgather", u8, comp.wire_bytes(numel, dtype))]
    if family == "two_phase":
        m = -(-numel // n)
        w = comp.wire_bytes(m, dtype)
        return [(tier, "all_to_all", u8, n * w), (tier, "allgather", u8, w)]
    if family == "shared_scale" and hasattr(comp, "bits"):
        from .algorithms.shared_scale import shared_scale_levels

        _, wdt = shared_scale_levels(comp.bits, n)
        return [(tier, "allreduce", str(wdt), numel * wdt.itemsize)]
    return []


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
        mem_per_element: seconds per element of one local elementwise pass (``c = a + b``)
            over a bucket-sized fp32 buffer; compressed candidates pay :data:`HOOK_PASSES` of
            them and hierarchical ones :data:`HIER_PASSES` more (0: not measured).
    """

    tiers: dict[str, TierCost]
    compute: dict[str, ComputeCost] = field(default_factory=dict)
    local_size: int = 1
    mem_per_element: float = 0.0

    # -- measurement ------------------------------------------------------------------
    @classmethod
    def probe(cls, comm: Communicator, compressors: Iterable[Compressor] = (), *,
              sizes=PROBE_SIZES, reps: int = 3, sample_numels=SAMPLE_NUMELS) -> "CostModel":
        """Measure every tier of ``comm`` and every compressor; same result on all ranks.

        Collective over ``comm`` (and its ``intra``/``inter`` groups when it is a
        :class:`~comms.topology.TieredCommunicator`). Re-runnable (links change). This is
        the quick start-up probe (fp32 allreduces of two sizes); :meth:`refine` adds the
        wire dtypes and bucket sizes actually used.
        """
        if len(sizes) != 2 or not 0 < sizes[0] < sizes[1]:
            raise ValueError(f"sizes must be two increasing byte counts, got {sizes!r}")
        tiers = _tier_comms(comm)
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
        compute = _fit_compute(compressors, sample_numels, vals[i:])
        local_size = tiers["intra"].world_size if "intra" in fitted else 1
        model = cls(fitted, compute, local_size)
        logger.info("cost model: %s", model)
        return model

    def refine(self, comm: Communicator, compressor: Compressor | None, buckets, algorithms,
               *, cap_bytes: int = PROBE_CAP_BYTES, compute_numel: int = COMPUTE_NUMEL) -> "CostModel":
        """A copy of this model with what the buckets will really use measured (collective).

        For every ``(tier, collective, wire dtype)`` that a candidate issues for one of
        ``buckets`` (``[(numel, dtype)]``), one timed collective at the largest such size
        (capped at ``cap_bytes``, so one entry costs about one such collective); the
        bandwidth is fitted with the tier's latency. Compute (compress/decompress and one
        local pass) is re-timed at ``min(largest bucket, compute_numel)`` elements and an
        eighth of that: realistic sizes, where caches do not flatter. One MAX over all ranks:
        every rank holds the same numbers. ``buckets`` and ``algorithms`` must be the same on
        every rank (they decide which collectives run).
        """
        tier_comms = _tier_comms(comm)
        need: dict[tuple, int] = {}
        for numel, dtype in buckets:
            for a in ["dense", *algorithms]:
                for tier, op, dt, nbytes in wire_ops(a, compressor, numel, dtype, self.tiers, self.local_size):
                    if tier in tier_comms and tier_comms[tier].world_size > 1:
                        need[(tier, op, dt)] = max(need.get((tier, op, dt), 0), int(nbytes))
        entries = sorted(need.items())  # the same order on every rank
        vec = []
        for (tier, op, dt), nbytes in entries:
            size = int(min(max(nbytes, 64 << 10), cap_bytes))
            vec.append(_time_op(comm, tier_comms[tier], op, _DTYPES[dt], size))
        big = max([n for n, _ in buckets] or [1 << 16])
        n2 = int(max(1 << 16, min(big, compute_numel)))
        numels = (max(1, n2 // 8), n2)
        vec.append(_time_mem_pass(n2))
        comps = [compressor] if compressor is not None else []
        for comp in comps:
            vec += _time_compute(comp, numels, 2)
        vals = _allreduce_max(comm, torch.tensor(vec, dtype=torch.float64)).tolist()
        tiers = dict(self.tiers)
        for ((tier, op, dt), nbytes), t in zip(entries, vals):
            base = tiers[tier]
            size = int(min(max(nbytes, 64 << 10), cap_bytes))
            link = max(t - base.alpha, 0.1 * t, 1e-9)  # noise must not make the link free
            tiers[tier] = base.with_betas({(op, dt): TierCost.factor(op, base.world) * size / link})
        mem = vals[len(entries)] / numels[1] if math.isfinite(vals[len(entries)]) else 0.0
        compute = dict(self.compute)
        compute.update(_fit_compute(comps, numels, vals[len(entries) + 1:]))
        model = CostModel(tiers, compute, self.local_size, mem)
        logger.info("cost model (refined at bucket sizes): %s", model)
        return model

    # -- prediction ---------------------------------------------------------------------
    def dense(self, numel: int, dtype=torch.float32, tier: str = "flat") -> float:
        return self.tiers[tier].allreduce(numel * _itemsize(dtype), dtype)

    def predict(self, algorithm: str, compressor: Compressor | None, numel: int,
                dtype=torch.float32) -> float:
        """Predicted seconds for one bucket: ``"dense"``, a flat algorithm, or ``hier_<alg>``."""
        if algorithm == "dense":
            return self.dense(numel, dtype)
        passes = HOOK_PASSES * self.mem_per_element * numel
        if algorithm.startswith("hier_"):
            if "inter" not in self.tiers:
                return math.inf
            inner = algorithm[len("hier_"):]
            L = self.local_size
            shard = -(-numel // L)
            es = _itemsize(dtype)
            intra = self.tiers["intra"]
            return (intra.all_to_all(L * shard * es, dtype) + self._flat(inner, "inter", compressor, shard, dtype)
                    + intra.allgather(shard * es, dtype) + passes + HIER_PASSES * self.mem_per_element * numel)
        return self._flat(algorithm, "flat", compressor, numel, dtype) + passes

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


def _tier_comms(comm: Communicator) -> dict[str, Communicator]:
    tiers = {"flat": comm}
    intra, inter = getattr(comm, "intra", None), getattr(comm, "inter", None)
    if intra is not None and inter is not None:
        tiers["intra"], tiers["inter"] = intra, inter
    return tiers


def _fit_compute(compressors, numels, vals) -> dict[str, ComputeCost]:
    """ComputeCost per compressor from ``[c(n1), c(n2), d(n1), d(n2)]`` groups of ``vals``."""
    out, i = {}, 0
    (n1, n2) = numels
    for comp in compressors:
        c1, c2, d1, d2 = vals[i: i + 4]
        i += 4
        if not all(map(math.isfinite, (c1, c2, d1, d2))):  # timing failed on some rank
            out[comp.spec()] = ComputeCost(math.inf)
            continue
        cs, ds = max(0.0, (c2 - c1) / (n2 - n1)), max(0.0, (d2 - d1) / (n2 - n1))
        out[comp.spec()] = ComputeCost(max(0.0, c1 - cs * n1), cs, max(0.0, d1 - ds * n1), ds)
    return out


def _itemsize(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _allreduce_max(comm: Communicator, t: torch.Tensor) -> torch.Tensor:
    """MAX over ranks with the sum-only interface: allgather, then max in rank order."""
    g = comm.all_gather(t).wait()
    return g.view(comm.world_size, -1).amax(0)


def _time_allreduce(flat: Communicator, c: Communicator, nbytes: int, reps: int) -> float:
    """Seconds per allreduce of ``nbytes`` on ``c``, every group of the tier at once.

    The median of single timed ops (at least 7 below 1 MiB, where one is a few ms): a mean
    lets one slow op (scheduling on a shared machine) inflate the fitted latency. The count
    depends only on the arguments, so it is the same on every rank.
    """
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    c.all_reduce(buf).wait()  # warm: connections, first touch
    one = torch.zeros(1)
    ts = []
    for _ in range(max(reps, 7) if nbytes < 1 << 20 else reps):
        # line every rank up before each timed op: back-to-back ops would also time the
        # skew between ranks that the previous op left behind (a hook's op starts aligned)
        flat.all_reduce(one).wait()
        t0 = time.perf_counter()
        c.all_reduce(buf).wait()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _time_op(flat: Communicator, c: Communicator, op: str, dtype: torch.dtype, nbytes: int) -> float:
    """Seconds of one ``op`` of ``nbytes`` of ``dtype`` on ``c`` (every group of the tier at once).

    A warm-up op of an eighth of the size first (connections, dtype paths), then one timed op
    at >= 1 MiB or the median of three below: a fixed count, the same on every rank.
    """
    numel = max(1, nbytes // dtype.itemsize)
    if op == "all_to_all":
        numel = max(c.world_size, numel - numel % c.world_size)
    run = {"allreduce": c.all_reduce, "allgather": c.all_gather, "all_to_all": c.all_to_all}[op]
    warm = torch.zeros(max(c.world_size, numel // 8 - (numel // 8) % c.world_size), dtype=dtype)
    buf = torch.zeros(numel, dtype=dtype)
    run(warm).wait()
    flat.all_reduce(torch.zeros(1)).wait()  # line every rank up before timing
    ts = []
    for _ in range(1 if nbytes >= 1 << 20 else 3):
        t0 = time.perf_counter()
        run(buf).wait()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _time_mem_pass(numel: int) -> float:
    """Seconds of one out-of-place ``c = a + b`` over ``numel`` fp32 (a local pass)."""
    a, b, c = torch.ones(numel), torch.ones(numel), torch.empty(numel)
    return _time(lambda: torch.add(a, b, out=c), 3)


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
