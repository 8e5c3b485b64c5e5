"""FSDP mode: a module's reduce-scatter through the engine (an FSDP ``ReduceScatter``).

:class:`CompressedReduceScatter` hands FSDP's flat padded gradient (``world x shard``) to
:func:`comms.core.engine.run` with :class:`FSDPSink`: the compressed route is
:data:`~comms.algorithms.scatter_reduce.scatter_reduce` (each rank compresses the chunk each
destination owns, one ``all_to_all``, the owner decodes and sums in rank order — computed once,
ARCHITECTURE.md §5), every rank's non-finite flag riding its payloads as one byte; the dense
route :data:`~comms.algorithms.dense.dense_reduce_scatter`, its flag (when some per-rank memory
needs one) in a 1-element all-reduce. The sink divides the owner's sum by FSDP's factor into
FSDP's output, NaN-fills it when any rank was non-finite, and — inside backward, when nothing
reads the output earlier — lands it when backward ends, so the exchange overlaps the rest of
backward. Parameters without a gradient keep their memory and get exact zeros
(:mod:`comms.fsdp.unused`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compressors.deferred import Deferred

from ..algorithms.dense import dense_reduce_scatter
from ..algorithms.scatter_reduce import scatter_reduce
from ..core.engine import Sink
from ..transport.waits import wait
from .module_step import ModuleStep

try:  # a private path of torch 2.11-2.13: ``import comms`` must not fail where it moved
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - FSDP duck-types the comm
    ReduceScatter = object

__all__ = ["CompressedReduceScatter", "FSDPSink"]

_LABELS = {scatter_reduce.name: "compressed"}


def _op_divides(op) -> bool:
    """True for AVG, False for SUM; anything else is refused (we cannot read a PREMUL_SUM factor)."""
    if op == dist.ReduceOp.SUM:
        return False
    if op == dist.ReduceOp.AVG:
        return True
    raise ValueError(f"commpress FSDP reduce-scatter got reduce op {op!r}; only SUM and AVG are "
                     "supported. comms.fsdp.register turns on set_force_sum_reduction_for_comms(True) "
                     "so that FSDP divides once itself; do not turn it off")


class FSDPSink(Sink):
    """FSDP's side of the engine (see the module docstring). ``call.dest``: ``(out, factor,
    defer, shield)`` — FSDP's output shard, what it is divided by (``None``: nothing), whether it
    may land when backward ends, the unused parameters' :class:`~comms.fsdp.unused.Shield`."""

    dense = dense_reduce_scatter

    def __init__(self, state):
        self.state = state

    def compressed(self, name):
        return scatter_reduce

    def wire_bytes(self, alg, compressor, ctx, world, shaped=True):
        # the scatter-reduce's payloads carry a flag byte each
        tail = (world - 1) if alg is scatter_reduce else 0
        return alg.wire_bytes(compressor, ctx.numel, ctx.dtype, world) + tail

    def what(self, comm, call, label):
        x = call.x
        return self.state.where(comm, f"FSDP {_LABELS.get(label, label)} reduce-scatter", call.index,
                                x.numel(), x.dtype, call.step)

    def prepare(self, comm, call, alg, flag, delivery):
        if alg is scatter_reduce:
            # the flag rides every payload as one byte; this rank's own chunk stays home exact
            # (not under momentum masking, whose velocity a chunk "sent" in full would lose)
            return {"exact_own": not delivery.mask, "tail": flag.to(torch.uint8).view(1)}, None
        return {}, None if flag is None else comm.all_reduce(flag.to(torch.float32).reshape(1))

    def land(self, comm, call, alg, fut, flag_fut, settle, what):
        st, idx = self.state, call.index
        out, factor, defer, shield = call.dest

        def finish() -> None:
            total = settle(wait(fut, comm.timeout, what))  # the owner's sum of this rank's chunk
            acc = total.materialize() if isinstance(total, Deferred) else total
            if isinstance(total, Deferred):
                flagged = total.tails.ne(0).any()  # every rank's flag byte: the same on every rank
            elif flag_fut is not None:
                flagged = (wait(flag_fut, comm.timeout, what) > 0).reshape(())
            else:
                flagged = None
            if factor is not None:
                acc = acc.div_(factor) if isinstance(total, Deferred) else acc.div(factor)
            out.copy_(acc)
            if flagged is not None:
                out.masked_fill_(flagged, float("nan"))
                st.reset_flagged_(idx, flagged)
            if shield is not None:  # parameters without a gradient: memory kept, result zero
                shield.restore_memory()
                shield.zero_(out)

        if defer and alg is scatter_reduce:
            st.backward_end.defer(finish)
        else:
            finish()


class CompressedReduceScatter(ModuleStep, ReduceScatter):
    """The FSDP-mode reduce-scatter of one module (an FSDP ``ReduceScatter``; see the module
    docstring). Built by :func:`comms.fsdp.register`; one instance per FSDP module.

    Args:
        state: the :class:`~comms.fsdp.state.FSDPCompressionState`.
        index: the module's index in ``state.modules``.
        module: the FSDP module, when FSDP's divide was handed over (``register`` sets the
            module's divide factor to 1 and this call divides by ``state.divide_factors``):
            then a compressed call inside backward returns once its exchange is issued, and
            the decode lands in FSDP's output when backward ends (an autograd final
            callback: :meth:`~comms.fsdp.backward_end.BackwardEnd.finish`) — the
            exchange overlaps the rest of backward. It stays synchronous where FSDP reads the
            output at once: a gradient to accumulate into, CPU offload, a post-accumulate-grad
            hook, a reduce dtype other than the parameters', a call ``auto`` times, or with
            an explicit ``timeout`` (each call then fails within it).
            ``None``: synchronous, the sum itself (FSDP divides).

    Example::

        >>> rs = CompressedReduceScatter(state, index=0)
        >>> out = rs.allocate((m,), dtype=torch.float32, device="cpu")
        >>> rs(out, flat_grad, group, dist.ReduceOp.SUM)   # out: this rank's summed shard
    """

    def __init__(self, state, index: int, module=None):
        super().__init__(state, index)
        self.module = module
        self.sink = FSDPSink(state)

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if async_op:
            raise ValueError("commpress FSDP reduce-scatter is synchronous; async_op=True is not supported")
        st = self.state
        comm = st.comm_for(group)
        x, out = input_tensor.view(-1), output_tensor.view(-1)
        if x.numel() != comm.world_size * out.numel() or not output_tensor.is_contiguous():
            raise ValueError(f"commpress FSDP reduce-scatter of module {st.modules[self.index]!r}: "
                             f"input {x.numel()} elements, output {out.numel()}, world "
                             f"{comm.world_size}; need input == world x output")
        factor = self._factor(_op_divides(op), comm.world_size)
        shield = st.unused.shield(st.memory, self.index, out.numel(), comm.world_size)
        dest = (out, factor, self._may_defer(out), shield)
        self.run(comm, x, self.sink, dest)
        return None  # FSDP ignores a returned Work: a deferred result lands when backward ends

    def _factor(self, divide: bool, world: int) -> float | None:
        """What the output is divided by here: FSDP's factor when it was handed over, else
        the group size for an AVG op, else nothing."""
        if self.module is not None:
            return self.state.divide_factors[self.index]
        return float(world) if divide else None

    def _may_defer(self, out: torch.Tensor) -> bool:
        """Whether nothing reads this call's output before backward ends (see the class)."""
        st = self.state
        if self.module is None or st.timeout is not None or torch._C._current_graph_task_id() == -1:
            return False  # an explicit timeout: bounded before FSDP issues its next collective
        if st.router.timed(self.index):
            return False  # a timed call: its transfer belongs to its time
        for g in self.module._get_fsdp_state()._fsdp_param_groups:
            for fp in g.fsdp_params:
                p = fp.sharded_param
                if p.grad is not None or fp.offload_to_cpu or p.dtype != out.dtype or \
                        getattr(p, "_post_accumulate_grad_hooks", None):
                    return False
        return True
