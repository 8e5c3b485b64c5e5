"""``hier_<name>``: two-tier aggregation — compression only on the slow, inter-node links.

1. intra-node reduce-scatter in full precision (all-to-all + local sum): local rank ``i`` of each node holds shard
   ``i`` of its node's sum ``S_node`` (fast links, no compression error);
2. the inner algorithm (``allreduce``, ``allgather``, ``two_phase``, ... any registered one)
   aggregates the shard across nodes over the inter-node group of local index ``i``, with
   compression; every rank of that group gets the same bits;
3. intra-node allgather of the aggregated shards: every rank of every node ends with the
   same buffer, so results are replica-identical.

Error feedback. The only compression error is made on ``S_node[i]`` by rank ``(node, i)``:
``e = S_node[i] - D(C(S_node[i]))``. It belongs to the node, not to this rank's ``x``, and it
must be re-injected exactly once. The algorithm therefore returns
``own = x`` everywhere except on its shard, where ``own = x - e``; the hook's residual
``x - own`` is then ``e`` on this rank's shard and 0 elsewhere, and next step the node's
reduce-scatter adds ``e`` back into ``S_node[i]``. Summed over all ranks, ``own`` equals the
aggregate and the residuals equal the total compression error (up to rounding: ``x - (x - e)``
is ``e`` to within an ulp of ``x``).

The communicator must be a :class:`comms.cluster.topology.TieredCommunicator` (``.intra`` and
``.inter``); the auto planner supplies one.

Example::

    >>> topo = comms.cluster.topology.Topology.discover()
    >>> comm = topo.communicator()
    >>> total, own = ALGORITHMS["hier_allreduce"](comm, compressors.from_spec("fp16"), x, ctx, {}).wait()
"""

from __future__ import annotations

import logging
import math

import torch

from .base import Algorithm, PLAIN, Want, round_wait

__all__ = ["Hierarchical", "HIER_PASSES"]

logger = logging.getLogger(__name__)


# local passes over the bucket the hierarchy adds (the node-local sum of the chunks, the
# copy for ``own``), charged at the cost model's measured per-element pass time
HIER_PASSES = 2


class Hierarchical(Algorithm):
    """The hierarchical form of the flat algorithm ``inner`` (composition, not a name prefix).

    Args:
        inner: the flat :class:`~comms.algorithms.base.Algorithm` used across nodes.
    """

    hierarchical = True
    # False even around two_phase: ``own`` here is this rank's whole x but the shard's error
    # (dense), so the hook cannot see what crossed the inter-node link; masking by the
    # aggregate would zero almost every velocity. The shard's error ``e`` is the node's
    # error-feedback residual, like a flat rank's (which is not masked either).
    holds_back = False

    def __init__(self, inner: Algorithm):
        if inner.hierarchical:
            raise ValueError(f"cannot nest hierarchies: {inner.name!r} is already hierarchical")
        self.inner = inner
        self.name = f"hier_{inner.name}"
        self.family = inner.family
        self.compress_stages = inner.compress_stages  # the intra-node steps do not compress

    def supports(self, compressor) -> bool:
        return self.inner.supports(compressor)

    @staticmethod
    def _tiers(comm):
        intra, inter = getattr(comm, "intra", None), getattr(comm, "inter", None)
        return intra, inter

    def wire_bytes(self, compressor, numel, dtype=torch.float32, world=2, local_size: int = 1) -> int:
        """Bytes each rank sends on the slow (inter-node) tier; ``local_size=1`` means flat."""
        nodes = max(1, world // max(1, local_size))
        return self.inner.wire_bytes(compressor, -(-numel // local_size), dtype, nodes)

    def wire_ops(self, model, compressor, numel, dtype, tier="flat"):
        if "inter" not in model.tiers:
            return []
        L = model.local_size
        shard = -(-numel // L)
        es = torch.empty(0, dtype=dtype).element_size()
        inner = self.inner.wire_ops(model, compressor, shard, dtype, "inter") \
            if model.tiers["inter"].world > 1 else []
        return ([("intra", "all_to_all", str(dtype), L * shard * es)] + inner
                + [("intra", "allgather", str(dtype), shard * es)])

    def cost(self, model, compressor, numel, dtype, tier="flat"):
        if "inter" not in model.tiers:
            return math.inf
        L = model.local_size
        shard = -(-numel // L)
        es = torch.empty(0, dtype=dtype).element_size()
        intra = model.tiers["intra"]
        return (intra.all_to_all(L * shard * es, dtype) + self.inner.cost(model, compressor, shard, dtype, "inter")
                + intra.allgather(shard * es, dtype) + HIER_PASSES * model.mem_per_element * numel)

    def flush_residual_(self, x, store, comm, numel=None):
        """The inner algorithm's residual, on this rank's shard of ``x``."""
        intra, inter = self._tiers(comm)
        if intra is None or inter is None:
            return False
        n = x.numel()
        shard = -(-n // intra.world_size)
        lo = intra.rank * shard
        return self.inner.flush_residual_(x[lo: min(n, lo + shard)], store, inter, numel=shard)

    def __call__(self, comm, compressor, x, ctx, store, want: Want = PLAIN):
        intra, inter = self._tiers(comm)
        if intra is None or inter is None:
            raise ValueError(f"algorithm {self.name!r} needs a TieredCommunicator (with .intra and "
                             f".inter), got {comm!r}; use algorithm='auto' or Topology.communicator()")
        inner = self.inner
        n, local, local_size = x.numel(), intra.rank, intra.world_size
        shard = -(-n // local_size)
        if shard * local_size == n:
            xp = x  # all_to_all reads its input and writes a fresh output
        else:
            xp = torch.zeros(shard * local_size, dtype=x.dtype, device=x.device)
            xp[:n].copy_(x)
        lo, hi = local * shard, min(n, (local + 1) * shard)
        sctx = ctx.with_(numel=shard, rank=inter.rank)

        # Rounds are issued from the caller's thread in program order and the first two are
        # waited for here: a round issued from a completion callback could race with the
        # next bucket's first round on the same group and mismatch collectives across ranks.
        # The reduce-scatter is all_to_all + a local sum: gloo's reduce_scatter has no
        # get_future() (torch 2.13), and the owner summing its chunks in local-rank order is
        # deterministic.
        chunks = round_wait(intra, intra.all_to_all(xp), ctx, "hierarchical intra-node all_to_all round")
        node_shard = chunks.view(local_size, shard).sum(0)
        shard_sum, shard_own = round_wait(inter, inner(inter, compressor, node_shard, sctx, store), ctx,
                                          f"hierarchical inter-node {self.inner.name} round")

        def done(fut):
            total = fut.value()[:n]
            own = x.clone()
            if hi > lo:  # own = x - e on this rank's shard (see the module docstring)
                own[lo:hi].sub_(node_shard[: hi - lo] - shard_own[: hi - lo].to(x.dtype))
            return total, own

        return intra.all_gather(shard_sum.contiguous()).then(done)

    def __repr__(self) -> str:
        return f"Hierarchical({self.inner.name!r})"
