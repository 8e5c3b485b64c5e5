"""``Planner``: the ``algorithm="auto"`` policy — per bucket, the cheapest predicted way.

The compression state owns one planner. On the first hook call (every rank is there, no
collective is in flight) :meth:`Planner.setup` discovers the topology, builds the intra- and
inter-node groups, and probes the :class:`~comms.tuning.cost_model.CostModel`. Afterwards
:meth:`Planner.choose` is pure arithmetic on numbers that are identical on every rank, so
every rank picks the same algorithm for the same bucket.

Candidates: ``"dense"`` (plain allreduce, always), every registered flat algorithm whose
family the compressor supports, and its ``hier_`` form when the topology has several nodes
with several ranks each. Small buckets (``numel < min_numel``) and buckets of only 1-D
tensors (biases, norms) go dense without asking the model. A compressed candidate must beat
dense by ``margin`` (the model does not see memory traffic or lost overlap).

Two measurements make the decision. At the first compressed step (bucket 0, nothing in
flight) the start-up model is *refined* at the sizes and wire dtypes the observed buckets
really use (:func:`comms.tuning.probe.refine`). Then, with ``autotune`` (the
default), the :class:`~comms.tuning.autotune.Autotuner` runs all-dense and the model's best few
plans for a few steps each, times the real steps, agrees on the times across ranks and locks
in the fastest (dense unless a compressed plan is >= 3% faster). The locked rule is saved in
the hook state's ``state_dict`` (a resumed run does not re-tune; ``state.retune()`` does).

Modules: this one holds the planner's bookkeeping (seen buckets, their rows, saved decisions,
the locked rule) and its persistence; a bucket's row and what a rule runs for it are
plan_table.py's, the ranking of rules for the tuner rule_ranking.py's, the agreed step times
step_seconds.py's; the model arithmetic is in cost_model.py, the measuring in probe.py, the
timed trials in autotune.py.

Example::

    >>> state = comms.register(ddp_model, "qsgd:bits=4")        # algorithm="auto" by default
    >>> ... train a few steps ...
    >>> print(state.plan)
    bucket      numel        bytes  chosen           dense  allgather  hier_allgather  (ms)
         0   25000000    100000000  hier_allgather  980.1   512.3      201.7
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Iterable, Sequence

import torch

from compressors import Compressor

from ..algorithms import ALGORITHMS, DENSE, get_algorithm
from .autotune import MODEL, Autotuner
from ..transport.communicator import Communicator
from .cost_model import CostModel
from ..transport.notices import notice
from ..transport.errors import where
from .probe import PROBE_SIZES, probe, refine
from .plan_table import Plan, PlanRow, apply_rule, decide_row, predicted_saving
from .rule_ranking import propose_rules, tie_preference
from .step_seconds import agree_step_seconds
from ..cluster.topology import Topology, tiered_communicator

__all__ = ["Planner", "Plan", "PlanRow", "DENSE", "MODEL"]

logger = logging.getLogger(__name__)


class Planner:
    """Chooses an algorithm (or ``"dense"``) per bucket from a measured cost model.

    Args:
        compressor: the state's compressor.
        topology: a :class:`~comms.cluster.topology.Topology` with groups built; default: discovered
            in :meth:`setup` (node names from ``node``, ``$COMMPRESS_NODE`` or hostnames).
        node: this rank's node name for discovery.
        cost_model: a ready :class:`~comms.tuning.cost_model.CostModel` (skips the probe).
        algorithms: candidate algorithm names (default: every registered one the compressor
            supports, flat and hierarchical). ``"dense"`` is always a candidate.
        min_numel: buckets smaller than this go dense.
        margin: a compressed candidate must be predicted at least this fraction faster than
            dense to be chosen.
        hierarchical: consider ``hier_`` algorithms when the topology allows.
        probe: measure a cost model in :meth:`setup` (off: topology and groups only, for an
            explicitly chosen ``hier_`` algorithm).
        probe_sizes, probe_reps: the probe's two allreduce sizes (bytes) and repetitions.
        autotune: time real steps of the best few plans and lock in the fastest (only with
            ``probe``); off: the cost model's choice is final.
        autotune_steps: steps per trial (>= 2; in the first round the first of each is not counted).
        autotune_trials: compressed plans tried besides all-dense.
        prefer_dense: a compressed plan must measure at least this much faster than dense.

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
                 probe_sizes=PROBE_SIZES, probe_reps: int = 3, autotune: bool = True,
                 autotune_steps: int = 2, autotune_trials: int = 3, prefer_dense: float = 0.03):
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {min_numel!r}")
        if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin!r}")
        if node is not None and not isinstance(node, str):
            raise TypeError(f"node must be a str, got {type(node).__name__}")
        if not isinstance(autotune, bool):
            raise TypeError(f"autotune must be True or False, got {autotune!r}")
        tuner = Autotuner(autotune_steps, autotune_trials, prefer_dense)  # validates the options
        self.tuner = tuner if autotune and probe else None
        tuner.preference = self._preference  # near-ties: compression stages, link bytes, codec, hops
        self.compressor = compressor
        self.topology = topology
        self.node = node
        self.model = cost_model
        self.allowed = None if algorithms is None else list(algorithms)
        if self.allowed is not None:
            for a in self.allowed:
                if a != DENSE:
                    get_algorithm(a)  # ValueError naming an unknown one, before any communication
        self.min_numel = min_numel
        self.margin = float(margin)
        self.use_hierarchy = hierarchical
        self.probe, self.probe_sizes, self.probe_reps = bool(probe), probe_sizes, probe_reps
        self._ndims: dict[tuple, list] = {}
        self._shapes: dict[tuple, tuple] = {}  # bucket key -> its tensor shapes (refine's compute)
        self.comm: Communicator | None = None
        self.ready = False
        self._rows: dict[tuple, PlanRow] = {}
        self._logged = False
        self._own_model = False  # the model came from our probe (refine it at bucket sizes)
        self._refined = False
        self._seen_prev: list[tuple] = []  # bucket keys of the previous step
        self._seen_cur: list[tuple] = []
        self._saved: dict[tuple, str] = {}  # restored decisions of a locked plan

    # -- setup (collective) ---------------------------------------------------------------
    def setup(self, comm: Communicator, process_group=None) -> Communicator:
        """Discover the topology, build groups, probe the links. Returns the communicator
        the algorithms should use (a :class:`~comms.cluster.topology.TieredCommunicator` when the
        topology is hierarchical). Idempotent."""
        if self.ready:
            return self.comm
        self.comm = comm
        if self.use_hierarchy:
            self.comm, self.topology = tiered_communicator(comm, process_group, self.node, self.topology)
        if self.model is None and self.probe and comm.world_size > 1:
            self.model = probe(self.comm, [self.compressor], sizes=self.probe_sizes,
                                         reps=self.probe_reps)
            self._own_model = True
        self.ready = True
        return self.comm

    # -- per step (collective at bucket 0) --------------------------------------------------
    def begin_step(self, step: int, start_iter: int, numel: int, dtype: torch.dtype,
                   warmup_steps: int = 0) -> None:
        """The hook's call for bucket 0 of every step, on every rank (nothing in flight).

        From ``start_iter`` on: refine the model at the buckets' real sizes once (collective),
        then let the autotuner pick this step's rule (its decision ends in one collective).
        The ``warmup_steps`` from ``start_iter`` (the compressor's ramp) are not counted.
        """
        now = time.perf_counter()  # first: the step's clock must not include our probes
        self._seen_prev, self._seen_cur = self._seen_cur, []
        if step < start_iter or not self.ready:
            return
        locked = self.tuner is not None and self.tuner.locked
        if self._own_model and not self._refined and not locked and self.comm is not None:
            buckets = {(n, dt) for (_, n, dt) in self._seen_prev} | {(numel, dtype)}
            self._refined = True
            # the largest bucket's tensor shapes (the same on every rank: DDP's buckets are)
            seen = [k for k in self._seen_prev if k in self._shapes]
            shapes = self._shapes[max(seen, key=lambda k: (k[1], -k[0]))] if seen else None
            self.model = refine(self.model, self.comm, self.compressor,
                                           sorted(buckets, key=lambda b: (b[0], str(b[1]))),
                                           self.candidate_names(), shapes=shapes)
            self._rows.clear()
        if self.tuner is None:
            return
        self.tuner.count_from = start_iter + warmup_steps
        was_locked, was_decision, rank = self.tuner.locked, self.tuner.decision, getattr(self.comm, "rank", None)
        keys = list(dict.fromkeys(self._seen_prev + [(0, numel, dtype)]))

        def propose() -> list[str]:  # once per trial phase: compressed rules, best predicted first
            if self.model is None:
                return []
            return propose_rules([self._row(k) for k in keys], self.candidate_names())

        def agree(values: list[float]) -> list[float]:  # the MAX over ranks, checked (collective)
            # issued in the hook's call for bucket 0 (errors name it like every per-bucket collective)
            what = where(self.comm, "autotune timing MAX-allgather", 0, numel, dtype, step)
            return agree_step_seconds(self.comm, values, what)

        def predict() -> dict[str, float]:  # the screen's predicted savings (comms.tuning.autotune)
            rows = [self._row(k) for k in keys]
            return {rule: predicted_saving(rows, rule) for rule in self.tuner.trials}

        self.tuner.begin_step(step, now, propose, agree, predict if self.model is not None else None)
        if self.tuner.locked and not was_locked:
            notice(logger, "commpress (step %d): %s", step, self.tuner.lock_summary(), rank=rank)
            logger.debug("commpress autotune trial table:\n%s", self.tuner)
            self._logged = False  # log the plan again under the locked rule
        elif was_locked and not self.tuner.locked:  # the watchdog: the runner-up won, or a slowdown
            notice(logger, "commpress (step %d): autotune tunes again (was %r)", step, was_decision, rank=rank)

    def retune(self) -> None:
        """Measure and tune again from the next step (call on every rank before the same step)."""
        if self.tuner is None:
            raise ValueError("this planner has no autotuner (autotune=False or not algorithm='auto')")
        self.tuner.reset()
        self._saved.clear()
        self._refined = False
        self._logged = False

    # -- choosing ---------------------------------------------------------------------------
    def candidate_names(self) -> list[str]:
        hier_ok = self.use_hierarchy and self.model is not None and "inter" in self.model.tiers
        names = []
        for name, alg in ALGORITHMS.items():
            if self.allowed is not None and name not in self.allowed:
                continue
            if not alg.supports(self.compressor):
                continue
            if alg.hierarchical and not hier_ok:
                continue
            names.append(name)
        return names

    def observe(self, bucket_index: int, numel: int, dtype: torch.dtype, bucket) -> None:
        """Remember the tensor ranks (for the 1-D rule) and shapes (for :meth:`refine`'s
        compute timing) of a DDP bucket not planned yet."""
        key = (bucket_index, numel, dtype)
        self._seen_cur.append(key)
        if key not in self._rows and key not in self._ndims:
            params = bucket.parameters()
            self._ndims[key] = [p.dim() for p in params]
            if sum(p.numel() for p in params) == numel:  # the layout the hook sees (shapes known)
                self._shapes[key] = tuple(tuple(p.shape) for p in params)

    def choose(self, bucket_index: int, numel: int, dtype: torch.dtype = torch.float32,
               ndims: Sequence[int] | None = None) -> str:
        """The algorithm for a bucket in this step, or ``"dense"`` (the plain allreduce).

        Pure arithmetic on numbers every rank holds identically (the agreed model and the
        autotuner's rule), so every rank picks the same.

        Args:
            bucket_index, numel, dtype: the bucket.
            ndims: dimensionality of each tensor in the bucket, when known; a bucket of only
                1-D tensors goes dense.
        """
        key = (bucket_index, numel, dtype)
        if key in self._rows and not self._logged:  # a repeated bucket: the step is planned
            self._logged = True
            logger.info("commpress plan:\n%s", self.plan)
        if not self.ready:  # before setup (e.g. a config check): decide nothing yet
            return DENSE
        rule = self.tuner.rule if self.tuner is not None else None  # in force this step
        if key in self._saved and self.tuner is not None and self.tuner.locked \
                and rule == self.tuner.decision:  # a restored lock: exactly what the saved run ran
            return self._saved[key]
        return apply_rule(rule or MODEL, self._row(key, ndims))

    def _row(self, key, ndims=None) -> PlanRow:
        """The row of the bucket ``key`` (decided once, until the model changes)."""
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = decide_row(
                self.model, self.compressor, *key, ndims if ndims is not None else self._ndims.get(key),
                self.candidate_names(), self.min_numel, self.margin)
        return row

    def _preference(self, rule: str) -> tuple:
        """The tuner's sort key of ``rule`` among tied winners over the buckets planned so far
        (:func:`~comms.tuning.rule_ranking.tie_preference`: the same key on every rank)."""
        return tie_preference(self.model, self.compressor, self._rows.values(), rule)

    def _locked_rule(self) -> str:
        t = self.tuner
        return (t.decision if t is not None and t.locked else (t.rule if t is not None else None)) or MODEL

    @property
    def plan(self) -> Plan:
        rule = self._locked_rule()
        rows = []
        for r in sorted(self._rows.values(), key=lambda r: (r.bucket, r.numel)):
            key = (r.bucket, r.numel, r.dtype)
            now = self._saved[key] if key in self._saved else apply_rule(rule, r)
            rows.append(replace(r, chosen=now, model_choice=r.chosen))
        return Plan(rows, self.model, self.topology, self.tuner)

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The autotuner's decision and the per-bucket choices under it (plain values)."""
        rule = self._locked_rule()
        decisions = [[b, n, str(dt), apply_rule(rule, r)] for (b, n, dt), r in sorted(
            self._rows.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2])))]
        decisions += [[b, n, str(dt), a] for (b, n, dt), a in self._saved.items()
                      if (b, n, dt) not in self._rows]
        return {"autotune": None if self.tuner is None else self.tuner.state_dict(),
                "decisions": decisions}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a locked plan (a resumed run does not re-tune; :meth:`retune` does)."""
        if not isinstance(sd, dict):
            raise TypeError(f"planner state must be a dict from Planner.state_dict(), got {sd!r}")
        saved = {}
        for row in sd.get("decisions", []):
            b, n, dt, a = row
            if a != DENSE and a not in ALGORITHMS:
                raise ValueError(f"saved plan names unknown algorithm {a!r}")
            saved[(int(b), int(n), getattr(torch, str(dt).replace("torch.", "")))] = str(a)
        tuned = sd.get("autotune")
        if self.tuner is not None and tuned is not None:
            self.tuner.load_state_dict(tuned)  # validates before changing anything
        self._saved = saved if (self.tuner is not None and self.tuner.locked) else {}
        self._logged = False

    def __getstate__(self):
        st = dict(self.__dict__)
        st["comm"], st["ready"] = None, False  # groups do not pickle; set up again
        return st
