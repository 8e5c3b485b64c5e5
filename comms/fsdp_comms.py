"""The FSDP2 and HSDP adapters over the gradient pipeline (:mod:`comms.pipeline`).

* :class:`CompressedReduceScatter` — FSDP mode: a module's reduce-scatter becomes the
  scatter-reduce half of ``two_phase``: each rank feeds its flat padded gradient through the
  local steps and error feedback, compresses the chunk each destination owns, one
  ``all_to_all`` moves them (every rank's non-finite flag rides its payloads as one byte),
  the owner decodes and sums them **in rank order** into its output shard. No second
  compression: the owner's sum is what FSDP keeps (ARCHITECTURE.md §5, "computed once").
* :class:`ReplicateAllReduce` — HSDP mode: after FSDP's own reduce-scatter inside the shard
  group, the module's output shard goes through the pipeline and a flat algorithm across the
  replicate group (``set_all_reduce_hook``).

The HSDP hook is synchronous (FSDP reads its output right after the call); the FSDP
reduce-scatter returns inside backward once its exchange is issued and lands its result when
backward ends (see :class:`CompressedReduceScatter`). Every wait of theirs is bounded by the
timeout (``comms.CollectiveTimeout`` names the module, step and rank). FSDP's own collectives
(full-precision parameter all-gathers; HSDP's reduce-scatter inside the shard group) and a
prefetched quantized all-gather's ``Work`` are bounded by the process group's timeout only. Units: FSDP sums
and divides afterwards by the module's divide factor, so the pipeline runs on the summed
units (``div`` 1) and the clip limit is scaled to them (``state.clip_limit``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from compressors import Context

from .algorithms import DENSE, get_algorithm
from .algorithms.two_phase import decode_sum, scatter_send
from .deadline import BoundedWork, clean_message, failure, wait, wait_work
from .pipeline import Delivery, feed_, local_flagged, nonfinite_flag, settle_, warm_step_goes_dense
from .stats import dense_wire_bytes, record_call

try:  # a private path of torch 2.11-2.13: ``import comms`` must not fail where it moved
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - FSDP duck-types the comm
    ReduceScatter = object

__all__ = ["CompressedReduceScatter", "ReplicateAllReduce", "ShardReduceScatter"]

# torch 2.13 renamed reduce_scatter_tensor (deprecated there) to reduce_scatter_single
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _op_divides(op) -> bool:
    """True for AVG, False for SUM; anything else is refused (we cannot read a PREMUL_SUM factor)."""
    if op == dist.ReduceOp.SUM:
        return False
    if op == dist.ReduceOp.AVG:
        return True
    raise ValueError(f"commpress FSDP reduce-scatter got reduce op {op!r}; only SUM and AVG are "
                     "supported. comms.fsdp.register turns on set_force_sum_reduction_for_comms(True) "
                     "so that FSDP divides once itself; do not turn it off")


class _ModuleStep:
    """What both adapters do around one module call: the step counter, the ``auto`` route and
    its timing, the drain of a residual once dense is the module's decision."""

    def __init__(self, state, index: int):
        self.state, self.index = state, index

    def _route(self, comm, step: int) -> tuple[str, int]:
        st, idx = self.state, self.index
        k = step - st.start_iter - st.warmup_steps
        if st.tuner is not None and st.tuner.due(idx, k):
            st.tuner.decide(idx, comm, st.modules[idx] or "<root>")
        route = st.route(idx, step)
        if route == DENSE and st.tuner is not None and idx in st.tuner.decision \
                and st.error_feedback and idx in st.memory.residuals:
            # dense is the decision: the residual goes out in equal shares over a few steps
            if idx not in st.memory.draining:
                st.memory.start_drain(idx, _DRAIN_STEPS)
        return route, k

    def _timed(self, comm, x, run) -> None:
        st, idx = self.state, self.index
        step = st.begin(idx, comm, x)
        route, k = self._route(comm, step)
        t0 = time.perf_counter()
        try:
            run(comm, x, step, route)
        except (RuntimeError, IndexError, OverflowError) as exc:
            # a collective issued here failed at once (a dead peer), or what a broken one handed
            # back does not decode: the error names the module, step and rank
            if clean_message(exc).startswith("commpress:"):
                raise
            raise failure(st.where(comm, f"FSDP {route} call", idx, x.numel(), x.dtype, step),
                              exc) from None
        if st.tuner is not None and step >= st.start_iter:
            st.tuner.record(idx, k, route, time.perf_counter() - t0)
        st.steps[idx] = step + 1

    def _dense_flag(self, x: torch.Tensor, world: int):
        """Local steps of a dense call (and a drain share); the flag when the module keeps
        per-rank memory a NaN must reset, else ``None``."""
        st, idx = self.state, self.index
        mbar = _velocity_start(st, st.steps.get(idx, 0))
        if not (st.local_transform or idx in st.memory.draining or mbar is not None):
            return None
        flag = local_flagged(st, idx, x, 1, st.clip_limit(idx, world), mbar)
        st.memory.drain_step_(idx, x)
        return flag


#: dense calls over which a module's residual is added once ``auto`` decided dense for it
_DRAIN_STEPS = 8


class CompressedReduceScatter(_ModuleStep, ReduceScatter):
    """The FSDP-mode reduce-scatter of one module (an FSDP ``ReduceScatter``; see the module
    docstring). Built by :func:`comms.fsdp.register`; one instance per FSDP module.

    Args:
        state: the :class:`~comms.fsdp_state.FSDPCompressionState`.
        index: the module's index in ``state.modules``.
        module: the FSDP module, when FSDP's divide was handed over (``register`` sets the
            module's divide factor to 1 and this call divides by ``state.divide_factors``):
            then a compressed call inside backward returns once its exchange is issued, and
            the decode lands in FSDP's output when backward ends (an autograd final
            callback: :meth:`~comms.fsdp_state.FSDPCompressionState.finish_pending`) — the
            exchange overlaps the rest of backward. It stays synchronous where FSDP reads the
            output at once: a gradient to accumulate into, CPU offload, a post-accumulate-grad
            hook, a reduce dtype other than the parameters', a call ``auto`` times, or with
            an explicit ``timeout`` (each call then fails within it, before FSDP's next
            collective — which only the process group's timeout bounds — can start).
            ``None``: synchronous, the sum itself (FSDP divides).

    Example::

        >>> rs = CompressedReduceScatter(state, index=0)
        >>> out = rs.allocate((m,), dtype=torch.float32, device="cpu")
        >>> rs(out, flat_grad, group, dist.ReduceOp.SUM)   # out: this rank's summed shard
    """

    def __init__(self, state, index: int, module=None):
        super().__init__(state, index)
        self.module = module

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
        divide = _op_divides(op)
        shield = st.unused.shield(st.memory, self.index, out.numel(), comm.world_size)
        self._timed(comm, x, lambda c, x_, step, route: self._run(c, x_, out, step, route, divide))
        if shield is not None:  # parameters without a gradient: memory kept, result zero
            shield.restore_memory()
            shield.zero_(out)  # read now when FSDP accumulates (then the call is synchronous)
        return None  # FSDP ignores a returned Work: a deferred result lands via finish_pending

    def _factor(self, divide: bool, world: int) -> float | None:
        """What the output is divided by here: FSDP's factor when it was handed over, else
        the group size for an AVG op, else nothing."""
        if self.module is not None:
            return self.state.divide_factors[self.index]
        return float(world) if divide else None

    def _may_defer(self, step: int, out: torch.Tensor) -> bool:
        """Whether nothing reads this call's output before backward ends (see the class)."""
        st = self.state
        if self.module is None or st.timeout is not None or torch._C._current_graph_task_id() == -1:
            return False  # an explicit timeout: bounded before FSDP issues its next collective
        if st.tuner is not None and self.index not in st.tuner.decision:
            return False  # a timed call: its transfer belongs to its time
        for g in self.module._get_fsdp_state()._fsdp_param_groups:
            for fp in g.fsdp_params:
                p = fp.sharded_param
                if p.grad is not None or fp.offload_to_cpu or p.dtype != out.dtype or \
                        getattr(p, "_post_accumulate_grad_hooks", None):
                    return False
        return True

    def _run(self, comm, x, out, step: int, route: str, divide: bool) -> None:
        st, idx, world = self.state, self.index, comm.world_size
        if route == DENSE:
            return self._dense(comm, x, out, step, divide, self._dense_flag(x, world), "dense")
        comp = st.compressor_for(step)
        flag = nonfinite_flag(x, feed_(st, idx, x, 1, st.clip_limit(idx, world), _velocity_start(st, step)))
        m = out.numel()
        if comp is not st.compressor and warm_step_goes_dense(
                comp, (world - 1) * (comp.wire_bytes(m, x.dtype) + 1), (world - 1) * m * x.element_size()):
            st.memory.residuals.pop(idx, None)  # it went with x; the velocity goes on
            return self._dense(comm, x, out, step, divide, flag, "dense (warm-up)")
        self._compressed(comm, comp, x, out, step, divide, flag)

    def _dense(self, comm, x, out, step, divide, flag, label) -> None:
        """A plain reduce-scatter (sum); a flag, when given, travels in a 1-element all-reduce."""
        st, idx, world = self.state, self.index, comm.world_size
        rec = record_call(st.stats, idx, x.numel(), x.dtype, x.element_size(), world, label, None)
        rec.dense_bytes = rec.wire_bytes = (world - 1) * out.numel() * x.element_size()
        what = st.where(comm, f"FSDP {label} reduce-scatter", idx, x.numel(), x.dtype, step)
        flag_fut = None if flag is None else comm.all_reduce(flag.to(torch.float32).reshape(1))
        res = wait(comm.reduce_scatter(x), comm.timeout, what)
        factor = self._factor(divide, world)
        out.copy_(res if factor is None else res.div(factor))
        if flag_fut is not None:
            flagged = (wait(flag_fut, comm.timeout, what) > 0).reshape(())
            out.masked_fill_(flagged, float("nan"))
            st.reset_flagged_(idx, flagged)

    def _compressed(self, comm, comp, x, out, step, divide, flag) -> None:
        st, idx, world, n, m = self.state, self.index, comm.world_size, x.numel(), out.numel()
        ctx = Context(numel=n, dtype=x.dtype, device=x.device, step=step, bucket=idx, rank=comm.rank,
                      seed=st.seed)
        rec = record_call(st.stats, idx, n, x.dtype, x.element_size(), world, "fsdp_reduce_scatter",
                          lambda: (world - 1) * (comp.wire_bytes(m, x.dtype) + 1), comp)
        rec.dense_bytes = (world - 1) * m * x.element_size()  # a reduce-scatter, not an allreduce
        what = st.where(comm, "FSDP compressed reduce-scatter", idx, n, x.dtype, step)
        d = Delivery(st, comp, False, None if st.adam is None else st.adam.masking(step))
        # this rank's own chunk stays home exact (not encoded, no residual): the codec does
        # (W-1)/W of the work. Not under momentum masking, whose velocity a chunk "sent" in
        # full every step would lose
        exact_own = not d.mask
        fut, own, layout, nb, stride = scatter_send(comm, comp, x, ctx, tail=flag.to(torch.uint8).view(1),
                                                    exact_own=exact_own)
        # every value sent lands in its owner's sum (no second compression): the residual is
        # x - own, and "held" masking has nothing to mask
        settle_own_(st, idx, x, own[:n], d)
        factor = self._factor(divide, world)

        def finish() -> None:
            recv = wait(fut, comm.timeout, what)
            acc = decode_sum(comp, recv, layout, nb, stride, ctx, world, comm.rank,  # rank order
                             exact=own[comm.rank * m:(comm.rank + 1) * m] if exact_own else None)
            flagged = recv.view(world, stride)[:, nb].ne(0).any()  # same value on every rank
            if factor is not None:
                acc.div_(factor)
            out.copy_(acc)
            out.masked_fill_(flagged, float("nan"))
            st.reset_flagged_(idx, flagged)

        if self._may_defer(step, out):
            st.defer(finish)
        else:
            finish()


_NO_MOMENTUM = torch.zeros(0)


def _velocity_start(st, step: int):
    """Adam's momentum space on FSDP/HSDP (sparsifiers, a velocity per rank): the shared
    momentum the velocity starts from — not gathered (each rank holds only its shards), so
    an empty tensor: the velocity starts at 0 when the variance freezes. ``None`` before."""
    return _NO_MOMENTUM if st.adam is not None and st.adam.active(step) else None


def settle_own_(st, idx: int, x: torch.Tensor, own: torch.Tensor, d: Delivery) -> None:
    """The residual and masks of a call whose aggregate this rank does not hold whole (the
    FSDP owner keeps its shard only): :func:`~comms.pipeline.settle_` without the write-back."""
    if d.error_feedback and d.mask:
        st.memory.update_masked_(idx, x, own, None)
    elif d.error_feedback:
        st.memory.update_(idx, x, own)
    elif d.mask:
        st.memory.mask_velocity_(idx, own)


class ReplicateAllReduce(_ModuleStep):
    """The HSDP-mode ``set_all_reduce_hook`` hook of one module: the output shard through the
    pipeline and a flat algorithm (sum) across the replicate group; FSDP divides afterwards.

    Example::

        >>> module.set_all_reduce_hook(ReplicateAllReduce(state, index=0))
    """

    def __call__(self, reduce_output: torch.Tensor) -> None:
        st = self.state
        comm = st.comm_for(st.replicate_group)
        x = reduce_output.view(-1)
        shield = st.unused.shield(st.memory, self.index, x.numel(), 1)
        if comm.world_size == 1:  # nothing to exchange; the local steps still apply
            if st.local_transform:
                local_flagged(st, self.index, x, 1, st.clip_limit(self.index, 1))
            st.steps[self.index] = st.steps.get(self.index, 0) + 1
        else:
            self._timed(comm, x, self._run)
        if shield is not None:  # parameters without a gradient: memory kept, result zero
            shield.restore_memory()
            shield.zero_(x)

    def _run(self, comm, x, step: int, route: str) -> None:
        st, idx, world = self.state, self.index, comm.world_size
        if route == DENSE:
            return self._dense(comm, x, step, self._dense_flag(x, world), "dense")
        comp = st.compressor_for(step)
        flag = nonfinite_flag(x, feed_(st, idx, x, 1, st.clip_limit(idx, world), _velocity_start(st, step)))
        alg = get_algorithm(st.flat_algorithm())
        if comp is not st.compressor and warm_step_goes_dense(
                comp, alg.wire_bytes(comp, x.numel(), x.dtype, world),
                dense_wire_bytes(x.numel(), x.element_size(), world)):
            st.memory.residuals.pop(idx, None)  # it went with x; the velocity goes on
            return self._dense(comm, x, step, flag, "dense (warm-up)")
        self._compressed(comm, alg, comp, x, step, flag)

    def _dense(self, comm, x, step, flag, label) -> None:
        st, idx = self.state, self.index
        record_call(st.stats, idx, x.numel(), x.dtype, x.element_size(), comm.world_size, label, None)
        what = st.where(comm, f"HSDP replicate {label} all-reduce", idx, x.numel(), x.dtype, step)
        flag_fut = None if flag is None else comm.all_reduce(_wire_flag(flag, x, comm))
        wait(comm.all_reduce(x), comm.timeout, what)
        if flag_fut is not None:
            self._flagged(x, wait(flag_fut, comm.timeout, what))

    def _compressed(self, comm, alg, comp, x, step, flag) -> None:
        st, idx, world = self.state, self.index, comm.world_size
        flag_fut = comm.all_reduce(_wire_flag(flag, x, comm))  # issued first, in program order
        ctx = Context(numel=x.numel(), dtype=x.dtype, device=x.device, step=step, bucket=idx,
                      rank=comm.rank, seed=st.seed)
        record_call(st.stats, idx, x.numel(), x.dtype, x.element_size(), world, alg.name,
                    lambda: alg.wire_bytes(comp, x.numel(), x.dtype, world) + 4, comp)
        what = st.where(comm, f"HSDP replicate {alg.name}", idx, x.numel(), x.dtype, step)
        d = Delivery(st, comp, alg.holds_back, None if st.adam is None else st.adam.masking(step))
        total, own = wait(alg(comm, comp, x, ctx, st.algo_store.setdefault(idx, {}),
                              **d.algorithm_kwargs(st, alg, idx, x)), comm.timeout, what)
        settle_(st, idx, x, total, own, d)
        self._flagged(x, wait(flag_fut, comm.timeout, what))

    def _flagged(self, x: torch.Tensor, flags: torch.Tensor) -> None:
        flagged = (flags.to(x.device) > 0).reshape(())
        x.masked_fill_(flagged, float("nan"))
        self.state.reset_flagged_(self.index, flagged)


def _wire_flag(flag: torch.Tensor, x: torch.Tensor, comm) -> torch.Tensor:
    """The flag as the 1-element fp32 tensor the flag all-reduce sums (on the host for gloo/MPI)."""
    bad = flag.to(torch.float32).reshape(1)
    if x.device.type != "cpu" and comm.backend in ("gloo", "mpi"):
        bad = bad.cpu()
    return bad


class ShardReduceScatter(ReduceScatter):
    """HSDP mode: the reduce-scatter inside the shard group — FSDP's own collective, the same
    call and the same bits — with commpress's bounded wait: a stopped or dead partner makes
    this rank raise within the timeout, naming the module, step and peer, instead of waiting
    in gloo past the process group's timeout while the other survivors have raised.

    Example::

        >>> module.set_custom_reduce_scatter(ShardReduceScatter(state, index=0))
    """

    def __init__(self, state, index: int):
        self.state, self.index = state, index

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        st, idx = self.state, self.index
        comm = st.comm_for(group)
        what = st.where(comm, "HSDP shard reduce-scatter", idx, input_tensor.numel(), input_tensor.dtype,
                        st.steps.get(idx, 0))
        try:
            work = _reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=True)
            if async_op:
                return BoundedWork(work, comm.timeout, what)
            wait_work(work, comm.timeout, what)
        except RuntimeError as exc:
            if clean_message(exc).startswith("commpress:"):
                raise
            raise failure(what, exc) from None
        return None
