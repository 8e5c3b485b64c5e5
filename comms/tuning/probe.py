"""Measuring the cost model (collective): the start-up probe and the refinement at bucket sizes.

Every measurement is max-reduced over all ranks before fitting, so every rank holds the same
numbers and makes the *same* plan — a plan that differed between ranks would mismatch
collectives (hang) or diverge replicas. Timed operations line the ranks up first (a hook's
collective starts aligned), single ops are summarised by their median (one slow op on a
shared machine must not inflate a fitted latency), and the number of timed ops depends only
on the arguments, so it is the same on every rank.

Example::

    >>> model = probe(topology.communicator(), compressors=[comp])
    >>> model = refine(model, comm, comp, [(25_000_000, torch.float32)], ["allreduce"])
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Iterable

import torch

from compressors import Compressor, Context

from ..algorithms import ALGORITHMS
from ..transport.communicator import Communicator, LocalCommunicator, allreduce_max
from .cost_model import ComputeCost, CostModel, TierCost
from ..transport.waits import wait

__all__ = ["probe", "refine", "shaped_sample", "PROBE_SIZES", "SAMPLE_NUMELS", "PROBE_CAP_BYTES", "PROBE_SECONDS",
           "COMPUTE_NUMEL"]

logger = logging.getLogger(__name__)

# bytes: the small end of real buckets (smaller ones go dense) and a bandwidth-bound size. gloo
# takes other code paths for tiny messages (16 KiB over 4 ranks measured slower than 256 KiB
# on netsim), so a latency fitted there mis-predicts the bucket sizes that matter
PROBE_SIZES = (128 << 10, 4 << 20)
SAMPLE_NUMELS = (1 << 12, 1 << 20)  # compressor timing sample sizes
PROBE_CAP_BYTES = 8 << 20  # refine(): largest probe collective (~70 ms at 1 Gb/s) ...
# ... unless the probed link moves more in PROBE_SECONDS: at 10 Gb/s one 8 MiB allreduce took
# 7.5-13.7 ms (+-30%) and the 25M model's dense allreduce was predicted at 74-196 ms against
# 103-127 measured (5 registrations); a 48 MiB one took 54-71 ms (+-13%)
PROBE_SECONDS = 0.06
COMPUTE_NUMEL = 1 << 22  # refine(): compute timed at up to 16 MB of fp32 (past the caches)
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                               torch.int8, torch.uint8, torch.int32, torch.int64)}



def probe(comm: Communicator, compressors: Iterable[Compressor] = (), *,
          sizes=PROBE_SIZES, reps: int = 3, sample_numels=SAMPLE_NUMELS) -> CostModel:
    """Measure every tier of ``comm`` and every compressor; same result on all ranks.

    Collective over ``comm`` (and its ``intra``/``inter`` groups when it is a
    :class:`~comms.cluster.topology.TieredCommunicator`). Re-runnable (links change). This is the
    quick start-up probe (fp32 allreduces of two sizes); :func:`refine` adds the wire dtypes
    and bucket sizes actually used.
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
    vals = allreduce_max(comm, torch.tensor(vec, dtype=torch.float64), f"commpress: cost-model probe MAX-allgather on rank {comm.rank} of {comm.world_size}").tolist()
    fitted, i = {}, 0
    for name, c in tiers.items():
        fitted[name] = TierCost.fit(name, c.world_size, sizes, vals[i: i + 2])
        i += 2
    compute = _fit_compute(compressors, sample_numels, vals[i:])
    local_size = tiers["intra"].world_size if "intra" in fitted else 1
    model = CostModel(fitted, compute, local_size)
    logger.info("cost model: %s", model)
    return model


def refine(model: CostModel, comm: Communicator, compressor: Compressor | None, buckets, algorithms,
           *, cap_bytes: int = PROBE_CAP_BYTES, compute_numel: int = COMPUTE_NUMEL,
           shapes=None) -> CostModel:
    """A copy of ``model`` with what the buckets will really use measured (collective).

    For every ``(tier, collective, wire dtype)`` that a candidate issues for one of
    ``buckets`` (``[(numel, dtype)]``), one timed collective at the largest such size (capped
    at ``cap_bytes`` or what ``model`` says the link moves in :data:`PROBE_SECONDS`, whichever
    is larger: one entry costs about one such collective, and on a fast link the one timed op
    is not lost in its noise); the bandwidth is fitted with the tier's latency. Compute
    (compress/decompress and one local pass) is re-timed at ``min(largest bucket,
    compute_numel)`` elements and an eighth of that: realistic sizes,
    where caches do not flatter. One MAX over all ranks: every rank holds the same numbers.
    ``buckets`` and ``algorithms`` must be the same on every rank (they decide which
    collectives run).

    ``shapes``: the tensor shapes of the largest bucket in bucket order (the same on every
    rank), or ``None``. A compressor whose work follows the tensors (:func:`_shape_bound`:
    PowerSGD factorizes each weight matrix) is then timed on the bucket's own leading tensors
    (:func:`shaped_sample`) and costed per element of that sample: timed flat, the bucket
    is one near-square matrix, a different computation (PowerSGD r1 on the bench MLP's 25M
    bucket, one thread: 1.7 ns/element per layer, 12.7 flat).
    """
    tier_comms = _tier_comms(comm)
    need: dict[tuple, int] = {}
    for numel, dtype in buckets:
        for a in ["dense", *algorithms]:
            for tier, op, dt, nbytes in model.wire_ops(a, compressor, numel, dtype):
                if tier in tier_comms and tier_comms[tier].world_size > 1:
                    need[(tier, op, dt)] = max(need.get((tier, op, dt), 0), int(nbytes))
    entries = sorted(need.items())  # the same order on every rank
    sizes = [_timed_bytes(model.tiers[tier], op, nbytes, cap_bytes) for (tier, op, _), nbytes in entries]
    vec = []
    for ((tier, op, dt), _), size in zip(entries, sizes):
        vec.append(_time_op(comm, tier_comms[tier], op, _DTYPES[dt], size))
    big = max([n for n, _ in buckets] or [1 << 16])
    n2 = int(max(1 << 16, min(big, compute_numel)))
    numels = (max(1, n2 // 8), n2)
    vec.append(_time_mem_pass(n2))
    comps = [compressor] if compressor is not None else []
    sample = shaped_sample(shapes, compute_numel) if shapes and comps and _shape_bound(comps[0]) else None
    for comp in comps:
        vec += _time_compute(comp, (_numel(sample),), 2, sample) if sample else _time_compute(comp, numels, 2)
    vals = allreduce_max(comm, torch.tensor(vec, dtype=torch.float64), f"commpress: cost-model probe MAX-allgather on rank {comm.rank} of {comm.world_size}").tolist()
    tiers = dict(model.tiers)
    for ((tier, op, dt), _), size, t in zip(entries, sizes, vals):
        base = tiers[tier]
        link = max(t - base.alpha, 0.1 * t, 1e-9)  # noise must not make the link free
        tiers[tier] = base.with_betas({(op, dt): TierCost.factor(op, base.world) * size / link})
    mem = vals[len(entries)] / numels[1] if math.isfinite(vals[len(entries)]) else 0.0
    compute = dict(model.compute)
    if sample:
        compute.update(_per_element_compute(comps[0], _numel(sample), vals[len(entries) + 1:]))
    else:
        compute.update(_fit_compute(comps, numels, vals[len(entries) + 1:]))
    out = CostModel(tiers, compute, model.local_size, mem)
    logger.info("cost model (refined at bucket sizes): %s", out)
    return out


def _timed_bytes(tier: TierCost, op: str, nbytes: int, cap_bytes: int) -> int:
    """Bytes of :func:`refine`'s timed ``op`` for an entry of ``nbytes``: ``nbytes`` (64 KiB at
    least), capped at the larger of ``cap_bytes`` and what ``tier`` moves in
    :data:`PROBE_SECONDS` (the same on every rank: the model is)."""
    beta, factor = tier.beta_for(op), TierCost.factor(op, tier.world)
    by_time = int(PROBE_SECONDS * beta / factor) if factor > 0 and 0 < beta < math.inf else 0
    return int(min(max(nbytes, 64 << 10), max(cap_bytes, by_time)))


def _time(fn, reps: int) -> float:
    fn()  # warm: first touch, lazy init
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _tier_comms(comm: Communicator) -> dict[str, Communicator]:
    tiers = {"flat": comm}
    intra, inter = getattr(comm, "intra", None), getattr(comm, "inter", None)
    if intra is not None and inter is not None:
        tiers["intra"], tiers["inter"] = intra, inter
    return tiers


def shaped_sample(shapes, numel: int) -> tuple[tuple[int, ...], ...]:
    """The bucket's leading whole tensors, up to the first prefix of at least ``numel``
    elements (or all of them): what a shape-bound compressor is timed on. Empty when the
    prefix holds no tensor of >= 2 dims (nothing shape-bound to time)."""
    out, total = [], 0
    for sh in shapes:
        out.append(tuple(int(d) for d in sh))
        total += math.prod(out[-1])
        if total >= numel:
            break
    return tuple(out) if any(len(sh) >= 2 for sh in out) else ()


def _shape_bound(comp: Compressor) -> bool:
    """Its compute follows the tensor shapes (a multi-round protocol: PowerSGD's per-layer
    factorization), not just the element count."""
    return comp.allreduce_rounds > 1


def _numel(shapes) -> int:
    return sum(math.prod(sh) for sh in shapes)


def _per_element_compute(comp: Compressor, numel: int, vals) -> dict[str, ComputeCost]:
    """ComputeCost from one shaped sample's ``[compress, decompress]`` seconds."""
    c, d = vals[:2]
    if not (math.isfinite(c) and math.isfinite(d)):
        return {comp.spec(): ComputeCost(math.inf)}
    return {comp.spec(): ComputeCost(0.0, c / numel, 0.0, d / numel)}


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


def _w(c: Communicator, fut, op: str):
    """A probe collective's wait, bounded by the communicator's timeout (comms.transport.waits)."""
    return wait(fut, getattr(c, "timeout", None),
                f"commpress: cost-model probe {op} on rank {c.rank} of {c.world_size}")


def _time_allreduce(flat: Communicator, c: Communicator, nbytes: int, reps: int) -> float:
    """Seconds per allreduce of ``nbytes`` on ``c``, every group of the tier at once.

    The median of single timed ops (at least 7 below 1 MiB, where one is a few ms): a mean
    lets one slow op (scheduling on a shared machine) inflate the fitted latency. The count
    depends only on the arguments, so it is the same on every rank.
    """
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    _w(c, c.all_reduce(buf), "allreduce")  # warm: connections, first touch
    one = torch.zeros(1)
    ts = []
    for _ in range(max(reps, 7) if nbytes < 1 << 20 else reps):
        # line every rank up before each timed op: back-to-back ops would also time the
        # skew between ranks that the previous op left behind (a hook's op starts aligned)
        _w(flat, flat.all_reduce(one), "barrier allreduce")
        t0 = time.perf_counter()
        _w(c, c.all_reduce(buf), "allreduce")
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
    _w(c, run(warm), op)
    _w(flat, flat.all_reduce(torch.zeros(1)), "barrier allreduce")  # line every rank up before timing
    ts = []
    for _ in range(1 if nbytes >= 1 << 20 else 3):
        t0 = time.perf_counter()
        _w(c, run(buf), op)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _time_mem_pass(numel: int) -> float:
    """Seconds of one out-of-place ``c = a + b`` over ``numel`` fp32 (a local pass)."""
    a, b, c = torch.ones(numel), torch.ones(numel), torch.empty(numel)
    return _time(lambda: torch.add(a, b, out=c), 3)


def _time_compute(comp: Compressor, numels, reps: int, shapes=()) -> list[float]:
    """[compress(n1), compress(n2), ..., decompress(n1), decompress(n2), ...] seconds on this
    device; with ``shapes`` (one size, their total), the input is a bucket of those tensors."""
    try:
        return _time_compute_unchecked(comp, numels, reps, shapes)
    except Exception:  # noqa: BLE001 - a rank must not skip the MAX that follows (hang)
        logger.warning("cost model: timing %s failed; it will not be planned", comp.spec(), exc_info=True)
        return [math.inf] * (2 * len(numels))


def _time_compute_unchecked(comp, numels, reps, shapes=()):
    g = torch.Generator().manual_seed(0)
    comp_t, dec_t = [], []
    for n in numels:
        x = torch.randn(n, generator=g)
        ctx = Context(numel=n, dtype=x.dtype, device=x.device, shapes=tuple(shapes))
        if comp.allreduce_rounds > 1:  # multi-round protocols (PowerSGD): time the aggregation whole
            local, alg = LocalCommunicator(), ALGORITHMS["allreduce"]
            comp_t.append(_time(lambda: alg(local, comp, x, ctx, {}).wait(), reps))
            dec_t.append(0.0)
            continue
        payload = comp.compress(x, ctx)
        comp_t.append(_time(lambda: comp.compress(x, ctx), reps))
        dec_t.append(_time(lambda: comp.decompress(payload, ctx), reps))
    return comp_t + dec_t
