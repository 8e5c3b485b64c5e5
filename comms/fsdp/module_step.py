"""What both FSDP adapters do around one module call: the step counter, the route, its timing.

:class:`ModuleStep` is the FSDP side of :func:`comms.core.engine.run`: before the data moves,
the configuration check and the replica guard (``state.begin``); the route — dense before the
first compressed step, then the compressed algorithm or, with ``algorithm="auto"``, the
module's :class:`~comms.tuning.module_tuner.ModuleTuner` decision (its timed calls alternate
dense and compressed; dense becomes settled, and drains the residual, once decided); the call
through the engine with the adapter's sink; its time for the tuner; the step counter.
"""

from __future__ import annotations

import time

import torch

from ..algorithms import DENSE
from ..core.engine import BEFORE_START, Call, Route, run
from ..transport.errors import clean_message, failure

__all__ = ["ModuleStep", "velocity_start"]

_NO_MOMENTUM = torch.zeros(0)


def velocity_start(st, step: int):
    """Adam's momentum space on FSDP/HSDP (sparsifiers, a velocity per rank): the shared
    momentum the velocity starts from — not gathered (each rank holds only its shards), so
    an empty tensor: the velocity starts at 0 when the variance freezes. ``None`` before."""
    return _NO_MOMENTUM if st.adam is not None and st.adam.active(step) else None


class ModuleStep:
    """One module's calls (see the module docstring); ``compressed``: the algorithm name of
    its compressed route."""

    def __init__(self, state, index: int):
        self.state, self.index = state, index

    def route(self, comm, step: int, compressed: str) -> tuple[Route, int]:
        """The route of this module's call at ``step`` and its tuning index (negative: not
        timed)."""
        st, idx = self.state, self.index
        start = st.first_step(step)
        if step < start:
            return BEFORE_START, -1
        if st.tuner is None:
            return Route(compressed), -1
        k = step - start - st.warmup_steps
        if st.tuner.due(idx, k):
            st.tuner.decide(idx, comm, st.modules[idx] or "<root>")
        decided = idx in st.tuner.decision
        name = DENSE if st.tuner.route(idx, k) == DENSE else compressed
        # a trial's dense call keeps the residual and the store for the compressed calls after it
        return Route(name, settled=decided, switches=decided), k

    def run(self, comm, x: torch.Tensor, sink, compressed: str, dest=None) -> None:
        """The module's call: route, the engine on ``x`` (summed units: FSDP divides after),
        the call's time for the tuner, the step counter."""
        st, idx = self.state, self.index
        step = st.begin(idx, comm, x)
        route, k = self.route(comm, step, compressed)
        call = Call(idx, step, x, route, div=1, limit=st.clip_limit(idx, comm.world_size),
                    mbar=velocity_start(st, step), dest=dest)
        t0 = time.perf_counter()
        try:
            run(st, comm, call, sink)
        except (RuntimeError, IndexError, OverflowError) as exc:
            # a collective issued here failed at once (a dead peer), or what a broken one handed
            # back does not decode: the error names the module, step and rank
            if clean_message(exc).startswith("commpress:"):
                raise
            raise failure(st.where(comm, f"FSDP {route.name} call", idx, x.numel(), x.dtype, step),
                          exc) from None
        if k >= 0:
            st.tuner.record(idx, k, route.name if route.name == DENSE else "compressed",
                            time.perf_counter() - t0)
        st.steps[idx] = step + 1
