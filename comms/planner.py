"""``Planner``: the ``algorithm="auto"`` policy — per bucket, the cheapest predicted way.

The compression state owns one planner. On the first hook call (every rank is there, no
collective is in flight) :meth:`Planner.setup` discovers the topology, builds the intra- and
inter-node groups, and probes the :class:`~comms.cost_model.CostModel`. Afterwards
:meth:`Planner.choose` is pure arithmetic on numbers that are identical on every rank, so
every rank picks the same algorithm for the same bucket.

Candidates: ``"dense"`` (plain allreduce, always), every registered flat algorithm whose
family the compressor supports, and its ``hier_`` form when the topology has several nodes
with several ranks each. Small buckets (``numel < min_numel``) and buckets of only 1-D
tensors (biases, norms) go dense without asking the model. A compressed candidate must beat
dense by ``margin`` (the model does not see memory traffic or lost overlap).

Example::

    >>> state = comms.register(ddp_model, "qsgd:bits=4")        # algorithm="auto" by default
    >>> ... train a few steps ...
    >>> print(state.plan)
    bucket      numel        bytes  chosen           dense  allgather  hier_allgather  (ms)
         0   25000000    100000000  hier_allgather  980.1   512.3      201.7
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from compressors import Compressor

from .communicator import Communicator, TorchCommunicator
from .cost_model import PROBE_SIZES, CostModel
from .topology import Topology

__all__ = ["Planner", "Plan", "PlanRow", "DENSE"]

logger = logging.getLogger(__name__)

DENSE = "dense"


@dataclass
class PlanRow:
    bucket: int
    numel: int
    dtype: torch.dtype
    nbytes: int
    chosen: str
    reason: str
    predicted: dict = field(default_factory=dict)  # candidate -> seconds


class Plan:
    """The per-bucket decisions so far; ``str(plan)`` is the table logged once."""

    def __init__(self, rows: Sequence[PlanRow], model: CostModel | None, topology: Topology | None):
        self.rows, self.model, self.topology = list(rows), model, topology

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, bucket: int) -> PlanRow:
        for r in self.rows:
            if r.bucket == bucket:
                return r
        raise KeyError(bucket)

    def __str__(self) -> str:
        names = []
        for r in self.rows:
            names += [k for k in r.predicted if k not in names]
        head = f"{'bucket':>6} {'numel':>11} {'bytes':>12} {'chosen':>16}  " + " ".join(f"{n:>15}" for n in names)
        lines = [head + "  (predicted ms)"]
        for r in self.rows:
            cells = " ".join(f"{r.predicted[n] * 1e3:>15.2f}" if n in r.predicted else f"{'-':>15}" for n in names)
            lines.append(f"{r.bucket:>6} {r.numel:>11} {r.nbytes:>12} {r.chosen:>16}  {cells}"
                         + (f"  [{r.reason}]" if r.reason != "cheapest" else ""))
        if self.topology is not None:
            lines.append(f"topology: nodes={self.topology.nodes}")
        if self.model is not None:
            lines.append(str(self.model))
        return "\n".join(lines)

    __repr__ = __str__


class Planner:
    """Chooses an algorithm (or ``"dense"``) per bucket from a measured cost model.

    Args:
        compressor: the state's compressor.
        topology: a :class:`~comms.topology.Topology` with groups built; default: discovered
            in :meth:`setup` (node names from ``node``, ``$COMMPRESS_NODE`` or hostnames).
        node: this rank's node name for discovery.
        cost_model: a ready :class:`~comms.cost_model.CostModel` (skips the probe).
        algorithms: candidate algorithm names (default: every registered one the compressor
            supports, flat and hierarchical). ``"dense"`` is always a candidate.
        min_numel: buckets smaller than this go dense.
        margin: a compressed candidate must be predicted at least this fraction faster than
            dense to be chosen.
        hierarchical: consider ``hier_`` algorithms when the topology allows.
        probe: measure a cost model in :meth:`setup` (off: topology and groups only, for an
            explicitly chosen ``hier_`` algorithm).
        probe_sizes, probe_reps: the probe's two allreduce sizes (bytes) and repetitions.

    .. warning::
        :meth:`setup` is collective (node-name allgather, ``new_group``, probe). The hook
        calls it on its first invocation, when every rank is in the same hook call and no
        other collective is in flight; call it yourself before training if your hook is
        called any other way.
    """

    def __init__(self, compressor: Compressor, *, topology: Topology | None = None,
                 node: str | None = None, cost_model: CostModel | None = None,
                 algorithms: Iterable[str] | None = None, min_numel: int = 1 << 14,
                 margin: float = 0.1, hierarchical: bool = True, probe: bool = True,
                 probe_sizes=PROBE_SIZES, probe_reps: int = 3):
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {min_numel!r}")
        if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        if node is not None and not isinstance(node, str):
            raise TypeError(f"node must be a str, got {type(node).__name__}")
        self.compressor = compressor
        self.topology = topology
        self.node = node
        self.model = cost_model
        self.allowed = None if algorithms is None else list(algorithms)
        if self.allowed is not None:
            from .algorithms import get_algorithm

            for a in self.allowed:
                if a != DENSE:
                    get_algorithm(a)  # ValueError naming an unknown one, before any communication
        self.min_numel = min_numel
        self.margin = float(margin)
        self.use_hierarchy = hierarchical
        self.probe, self.probe_sizes, self.probe_reps = bool(probe), probe_sizes, probe_reps
        self._ndims: dict[tuple, list] = {}
        self.comm: Communicator | None = None
        self.ready = False
        self._rows: dict[tuple, PlanRow] = {}
        self._logged = False

    # -- setup (collective) ---------------------------------------------------------------
    def setup(self, comm: Communicator, process_group=None) -> Communicator:
        """Discover the topology, build groups, probe the links. Returns the communicator
        the algorithms should use (a :class:`~comms.topology.TieredCommunicator` when the
        topology is hierarchical). Idempotent."""
        if self.ready:
            return self.comm
        from .algorithms import ALGORITHMS
        from .algorithms.hierarchical import register_missing

        register_missing(ALGORITHMS)
        self.comm = comm
        if comm.world_size > 1 and self.use_hierarchy and getattr(comm, "intra", None) is None:
            if self.topology is None and isinstance(comm, TorchCommunicator):
                group = comm.group if process_group is None else process_group
                self.topology = Topology.discover(group, self.node, build_groups=False)
                if self.topology.hierarchical:
                    self.topology.build_groups(group)
            if self.topology is not None and self.topology.hierarchical:
                if self.topology.intra is None:
                    raise ValueError("Planner(topology=...) needs Topology.build_groups() first")
                self.comm = self.topology.communicator(comm)
        if self.model is None and self.probe and comm.world_size > 1:
            self.model = CostModel.probe(self.comm, [self.compressor], sizes=self.probe_sizes,
                                         reps=self.probe_reps)
        self.ready = True
        return self.comm

    def reprobe(self) -> CostModel:
        """Measure again (collective) and forget the plan (links may have changed)."""
        if self.comm is None:
            raise RuntimeError("Planner.reprobe() before setup()")
        self.model = CostModel.probe(self.comm, [self.compressor], sizes=self.probe_sizes,
                                     reps=self.probe_reps)
        self._rows.clear()
        self._logged = False
        return self.model

    # -- choosing ---------------------------------------------------------------------------
    def candidate_names(self) -> list[str]:
        from .algorithms import ALGORITHMS

        hier_ok = self.use_hierarchy and self.model is not None and "inter" in self.model.tiers
        names = []
        for name, alg in ALGORITHMS.items():
            if self.allowed is not None and name not in self.allowed:
                continue
            if not self.compressor.supports(alg.family):
                continue
            if getattr(alg, "hierarchical", False) and not hier_ok:
                continue
            names.append(name)
        return names

    def observe(self, bucket_index: int, numel: int, dtype: torch.dtype, bucket) -> None:
        """Remember the tensor ranks of a DDP bucket not planned yet (for the 1-D rule)."""
        key = (bucket_index, numel, dtype)
        if key not in self._rows and key not in self._ndims:
            self._ndims[key] = [p.dim() for p in bucket.parameters()]

    def choose(self, bucket_index: int, numel: int, dtype: torch.dtype = torch.float32,
               ndims: Sequence[int] | None = None) -> str:
        """The algorithm name for a bucket, or ``"dense"`` (route to the plain allreduce).

        Args:
            bucket_index, numel, dtype: the bucket.
            ndims: dimensionality of each tensor in the bucket, when known; a bucket of only
                1-D tensors goes dense.
        """
        key = (bucket_index, numel, dtype)
        row = self._rows.get(key)
        if row is not None:
            if not self._logged:  # a repeated bucket: the first planned iteration is complete
                self._logged = True
                logger.info("commpress plan:\n%s", self.plan)
            return row.chosen
        if not self.ready:  # before setup (e.g. a config check): decide nothing yet
            return DENSE
        row = self._decide(bucket_index, numel, dtype, ndims if ndims is not None else self._ndims.get(key))
        self._rows[key] = row
        return row.chosen

    def _decide(self, bucket_index, numel, dtype, ndims) -> PlanRow:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        row = PlanRow(bucket_index, numel, dtype, nbytes, DENSE, "cheapest")
        if self.model is None:
            row.reason = "no cost model (one rank or not set up)"
            return row
        row.predicted = self.model.candidates(self.compressor, numel, dtype, self.candidate_names())
        if numel < self.min_numel:
            row.reason = f"small (< {self.min_numel} elements)"
            return row
        if ndims is not None and len(ndims) and max(ndims) <= 1:
            row.reason = "1-D tensors only"
            return row
        dense_t = row.predicted[DENSE]
        best, best_t = DENSE, dense_t
        for name, t in row.predicted.items():  # insertion order: ties keep the earlier one
            if name != DENSE and t < best_t and t < dense_t * (1 - self.margin):
                best, best_t = name, t
        row.chosen = best
        return row

    @property
    def plan(self) -> Plan:
        return Plan(sorted(self._rows.values(), key=lambda r: (r.bucket, r.numel)), self.model, self.topology)

    def __getstate__(self):
        st = dict(self.__dict__)
        st["comm"], st["ready"] = None, False  # groups do not pickle; set up again
        return st
