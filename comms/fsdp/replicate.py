"""HSDP mode: shard within a node, replicate across nodes.

The model is 1-D ``fully_shard`` over the *shard* group. FSDP's own full-precision
reduce-scatter runs inside the shard group (fast links) — :class:`~comms.fsdp.bounded.BoundedReduceScatter`
issues exactly FSDP's collective, with commpress's bounded wait — and the module's output shard then
goes through :func:`comms.core.engine.run` across the replicate group in
:class:`ReplicateAllReduce` (FSDP's ``set_all_reduce_hook``) with :class:`HSDPSink`: a flat
algorithm (``allreduce``, ``allgather``, ``two_phase``) or the plain all-reduce, the non-finite
flag in a 1-element all-reduce issued first; synchronous (FSDP reads the shard right after),
summed in place (FSDP divides afterwards).
"""

from __future__ import annotations

import torch

from ..algorithms import get_algorithm
from ..algorithms.dense import dense_allreduce
from ..core.engine import Sink
from ..core.stages import local_flagged
from ..transport.waits import wait
from .module_step import ModuleStep

__all__ = ["ReplicateAllReduce", "HSDPSink"]


class HSDPSink(Sink):
    """HSDP's side of the engine (see the module docstring); ``call.dest``: ``(shield, divide)``
    — the unused parameters' :class:`~comms.fsdp.unused.Shield` or ``None``, what the sum is
    divided by here (``None``: FSDP divides)."""

    dense = dense_allreduce

    def __init__(self, state):
        self.state = state

    def compressed(self, name):
        return get_algorithm(name)

    def wire_bytes(self, alg, compressor, ctx, world, shaped=True):
        flag = 4 if shaped and alg is not self.dense else 0  # the flag all-reduce
        return alg.wire_bytes(compressor, ctx.numel, ctx.dtype, world) + flag

    def what(self, comm, call, label):
        x = call.x
        text = f"HSDP replicate {label} all-reduce" if label.startswith("dense") else f"HSDP replicate {label}"
        return self.state.where(comm, text, call.index, x.numel(), x.dtype, call.step)

    def prepare(self, comm, call, alg, flag, delivery):
        if flag is None:
            return {}, None
        bad = flag.to(torch.float32).reshape(1)  # issued first, in program order
        if call.x.device.type != "cpu" and comm.backend in ("gloo", "mpi"):
            bad = bad.cpu()
        return {}, comm.all_reduce(bad)

    def land(self, comm, call, alg, fut, flag_fut, settle, what):
        st, x = self.state, call.x
        settle(wait(fut, comm.timeout, what))  # the sum, written into x
        if flag_fut is not None:
            flagged = (wait(flag_fut, comm.timeout, what).to(x.device) > 0).reshape(())
            x.masked_fill_(flagged, float("nan"))
            st.reset_flagged_(call.index, flagged)
        _finish(x, *call.dest)


def _finish(x: torch.Tensor, shield, divide) -> None:
    if divide is not None:
        x.div_(divide)  # where FSDP's post-divide would be: the same operation, the same bits
    if shield is not None:  # parameters without a gradient: memory kept, result zero
        shield.restore_memory()
        shield.zero_(x)


class ReplicateAllReduce(ModuleStep):
    """The HSDP-mode ``set_all_reduce_hook`` hook of one module: the output shard through the
    engine across the replicate group (sum); FSDP divides afterwards — or, with ``divide``
    (one rank per shard group, where FSDP would divide twice), this hook.

    Example::

        >>> module.set_all_reduce_hook(ReplicateAllReduce(state, index=0))
    """

    def __init__(self, state, index: int, divide: float | None = None):
        super().__init__(state, index)
        self.sink, self.divide = HSDPSink(state), divide

    def __call__(self, reduce_output: torch.Tensor) -> None:
        st, idx = self.state, self.index
        comm = st.comm_for(st.replicate_group)
        x = reduce_output.view(-1)
        shield = st.unused.shield(st.memory, idx, x.numel(), 1)
        if comm.world_size > 1:
            self.run(comm, x, self.sink, (shield, self.divide))
            return
        if st.local_transform:  # nothing to exchange; the local steps still apply
            local_flagged(st, idx, x, 1, st.clip_limit(idx, 1))
        st.steps[idx] = st.steps.get(idx, 0) + 1
        _finish(x, shield, self.divide)
