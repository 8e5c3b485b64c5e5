"""What both FSDP adapters do around one module call: the step counter, the route, its timing.

:class:`ModuleStep` is the FSDP side of :func:`comms.core.engine.run`: before the data moves,
the configuration check and the replica guard (``state.begin``); the route
(``state.router``: :mod:`comms.tuning.router`); the call through the engine with the adapter's
sink; its time for the router; the step counter.
"""

from __future__ import annotations

import time

import torch

from ..core.engine import Call, run
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

    def run(self, comm, x: torch.Tensor, sink, dest=None) -> None:
        """The module's call: its route (``state.router``), the engine on ``x`` (summed units:
        FSDP divides after), the call's time for the router, the step counter."""
        st, idx = self.state, self.index
        step = st.begin(idx, comm, x)
        route = st.router.route(st, comm, idx, step, x.numel(), x.dtype)
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
        st.router.took(st, idx, step, route, time.perf_counter() - t0)
        st.steps[idx] = step + 1
