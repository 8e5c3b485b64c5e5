"""Routers: how a gradient's route is chosen at each step — one contract for DDP buckets and
FSDP/HSDP modules.

A :class:`~comms.algorithms.base.Route` names what a gradient runs at a step (an algorithm, or
dense) and whether a dense route is settled. Every adapter asks its state's router the same way,
before the data moves, and tells it what the call took afterwards::

    route = state.router.route(state, comm, index, step, numel, dtype)
    comms.core.engine.run(state, comm, Call(index, step, x, route, ...), sink)
    state.router.took(state, index, step, route, seconds)

Every router routes dense before the state's first compressed step (``start_iter``, or the
freeze of Adam's variance) and for gradients under ``min_compress_numel``. Then:

* :class:`FixedRouter` — a pinned algorithm, every step;
* :class:`PlannerRouter` — DDP's ``algorithm="auto"``: the cost-model planner and its
  autotuner (:mod:`comms.tuning.planner`), which time whole steps (DDP's hook returns before
  the data moved) and run one rule for every bucket at a step;
* :class:`ModuleRouter` — FSDP/HSDP's ``algorithm="auto"``: per module, calls timed
  alternately dense and compressed (:class:`~comms.tuning.module_tuner.ModuleTuner`; FSDP's
  calls are synchronous, so a call's wall time is what it costs).
"""

from __future__ import annotations

from ..algorithms import DENSE
from ..algorithms.base import BEFORE_START, Route
from .module_tuner import COMPRESSED

__all__ = ["Router", "FixedRouter", "PlannerRouter", "ModuleRouter"]


class Router:
    """The contract (see the module docstring); subclasses choose after the first step."""

    def route(self, st, comm, index: int, step: int, numel: int, dtype) -> Route:
        """The route of gradient ``index`` at ``step`` (the same on every rank)."""
        if step < st.first_step(step) or numel < getattr(st, "min_compress_numel", 0):
            return BEFORE_START
        return self.choose(st, comm, index, step, numel, dtype)

    def choose(self, st, comm, index: int, step: int, numel: int, dtype) -> Route:
        raise NotImplementedError

    def took(self, st, index: int, step: int, route: Route, seconds: float) -> None:
        """What the call took (routers that time calls record it)."""

    def timed(self, index: int) -> bool:
        """Whether gradient ``index``'s calls are being timed (its transfer belongs to its time:
        it must not overlap anything)."""
        return False


class FixedRouter(Router):
    """A pinned algorithm on every compressed step."""

    def __init__(self, name: str):
        self.name = name

    def choose(self, st, comm, index, step, numel, dtype) -> Route:
        return Route(self.name)


class PlannerRouter(Router):
    """DDP's ``algorithm="auto"``: what the planner's rule in force runs for the bucket; its
    dense is settled unless this step is a tuning trial's or a check's."""

    def __init__(self, planner):
        self.planner = planner

    def choose(self, st, comm, index, step, numel, dtype) -> Route:
        name = self.planner.choose(index, numel, dtype)
        tuner = self.planner.tuner
        trial = tuner is not None and (not tuner.locked or tuner.rule != tuner.decision)
        return Route(name, settled=not trial)


class ModuleRouter(Router):
    """FSDP/HSDP's ``algorithm="auto"``: a module's timed calls alternate dense and
    ``compressed`` until its :class:`~comms.tuning.module_tuner.ModuleTuner` decides (one tiny
    all-reduce: the same decision on every rank); a trial's dense call keeps the residual and
    the store for the compressed calls after it."""

    def __init__(self, tuner, compressed: str):
        self.tuner, self.compressed = tuner, compressed

    def _k(self, st, step: int) -> int:
        return step - st.first_step(step) - st.warmup_steps

    def choose(self, st, comm, index, step, numel, dtype) -> Route:
        k = self._k(st, step)
        if self.tuner.due(index, k):
            self.tuner.decide(index, comm, st.modules[index] or "<root>")
        decided = index in self.tuner.decision
        name = DENSE if self.tuner.route(index, k) == DENSE else self.compressed
        return Route(name, settled=decided, switches=decided)

    def took(self, st, index, step, route, seconds) -> None:
        if route is not BEFORE_START:
            self.tuner.record(index, self._k(st, step), DENSE if route.name == DENSE else COMPRESSED, seconds)

    def timed(self, index: int) -> bool:
        return index not in self.tuner.decision
