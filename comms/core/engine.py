"""The step of one flat gradient: the one place the pipeline's stages run, in order.

Whatever trains — a DDP bucket (:mod:`comms.ddp.hook`), an FSDP module's reduce-scatter or an
HSDP shard's replicate all-reduce (:mod:`comms.fsdp`) — :func:`run` takes one flat gradient
through::

    route      the tuner's choice for this gradient and step (a compressed algorithm or dense);
               a switch away from an algorithm gives its kept residual back once
    feed       this rank's local steps (its share, clipping, momentum correction or Adam's
               momentum) and error feedback, in place (comms.core.stages.feed_)
    flag       the non-finite flag of what is sent (a tensor: no host sync)
    warm-up    a warm-up variant that would send too much goes dense instead
    algorithm  Algorithm(comm, compressor, x, ctx, store, want) -> Future[(sum, own)]
    settle     residual x - own, momentum masking, the sum written back (comms.core.stages.settle_)

The dense route runs the same way with the dense algorithm: the local steps (when some memory
changes), a residual drained over a few steps once dense is the decision.

The adapter describes the call (:class:`Call`) and hands a :class:`Sink`: which algorithm
carries a route, what the collective must also carry, how the flag travels and how the result
lands — DDP's future through the step's flags; FSDP's output shard, divided, maybe when
backward ends; HSDP's shard in place. A sink translates; it keeps no pipeline state: every
residual, velocity, store and statistic lives in the :class:`~comms.core.gradient_state.GradientState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from compressors import Context

from ..algorithms import ALGORITHMS, DENSE
from ..algorithms.base import BEFORE_START, Route
from ..transport.errors import round_failure
from .stages import Delivery, feed_, local_flagged, nonfinite_flag, settle_, warm_step_goes_dense
from .stats import record_call

__all__ = ["Call", "Route", "BEFORE_START", "Sink", "run", "DRAIN_STEPS"]

#: dense steps over which a gradient's error-feedback residual is added once dense is the
#: decision for it (a trial's dense steps leave the residual for the compressed steps that
#: follow): random-k 1%'s residual holds up to 5 steps of gradient (its residual bound), so
#: each of 8 shares adds under a step; added at once it was a 10x step (docs/design-notes.md,
#: "Residual drain")
DRAIN_STEPS = 8


@dataclass
class Call:
    """One flat gradient's step, as the adapter hands it over.

    Attributes:
        index: the gradient's index (its memory's key: a DDP bucket, an FSDP module).
        step: the step (the hash RNG's counter, the warm-up ramp).
        x: the flat gradient, this rank's contribution; fed and settled in place.
        route: the :class:`~comms.algorithms.base.Route` (its router's choice).
        div: this rank's share of the average (DDP: the world size, divided here; FSDP/HSDP: 1,
            summed units: the adapter divides afterwards).
        limit: the clip limit of this rank's share (``None``: no clipping).
        mbar: Adam's momentum space once the variance froze (:mod:`comms.core.adam`): the
            DDP bucket's :class:`~comms.core.adam_share.Share`, or FSDP's velocity start (a
            tensor); else ``None``.
        params: what went through Adam's momentum space, for its frozen-variance step
            (:meth:`comms.core.adam.FrozenVarianceAdam.mark`: the parameters, or FSDP's module
            index).
        shapes: the parameter shapes ``x`` is made of (``()``: unknown).
        dest: where the sink lands the result (its own business: a split bucket's scatter,
            FSDP's output shard and divide factor).
        amax: the fp32 bits of the largest ``|x|`` where the adapter's own compiled pass wrote
            ``x`` (the outer sync's send): the non-finite flag's pass is spared when no local
            step or residual rewrites ``x`` (:func:`comms.core.stages.feed_`); else ``None``.
    """

    index: int
    step: int
    x: torch.Tensor
    route: Route
    div: int = 1
    limit: float | None = None
    mbar: Any = None
    shapes: tuple = ()
    dest: Any = None
    amax: int | None = None
    params: Any = ()


class Sink:
    """How an adapter's gradient travels and lands (subclassed by each adapter).

    Attributes:
        dense: the algorithm of the dense route (``comms.algorithms.dense``).
    """

    dense = None

    def compressed(self, name: str):
        """The algorithm a compressed route names."""
        return ALGORITHMS[name]

    def wire_bytes(self, alg, compressor, ctx: Context, world: int, shaped: bool = True) -> int:
        """Bytes one rank sends for ``alg``: what the stats show (``shaped``: counted for the
        bucket's tensor shapes) and, flat, what the warm-up rule weighs."""
        if shaped:
            return alg.bucket_wire_bytes(compressor, ctx, world)
        return alg.wire_bytes(compressor, ctx.numel, ctx.dtype, world)

    def prepare(self, comm, call: Call, alg, flag, delivery):
        """Before the algorithm runs: ``(want fields, flag handle)`` — what the collective
        must also carry (a reduce-scatter's ``exact_own``, a flag riding the payloads; ``delivery``
        is the compressed call's :class:`~comms.core.stages.Delivery`, ``None`` on the dense
        route) and the flag's own transport, issued first (program order)."""
        return {}, flag

    def what(self, comm, call: Call, label: str) -> str:
        """The name of this call in errors (collective, gradient, step, rank)."""
        raise NotImplementedError

    def land(self, comm, call: Call, alg, fut, flag, settle, what: str):
        """Place the result of ``alg``: ``fut`` gives ``(sum, own)``; ``settle((sum, own))``
        settles the memory and returns what to place (``x`` written, or a shard); ``flag`` is
        what :meth:`prepare` returned for it. Returns what the adapter returns to its framework."""
        raise NotImplementedError


def run(st, comm, call: Call, sink: Sink):
    """One step of one flat gradient (see the module docstring); returns what ``sink.land``
    returns."""
    switched = _switch(st, call)
    if call.route.name == DENSE:
        return _dense(st, comm, call, sink, switched)
    x, idx = call.x, call.index
    st.memory.draining.pop(idx, None)  # back to compressing: what is left is a residual again
    compressor = st.compressor_for(call.step)  # the warm-up ramp's variant
    alg = sink.compressed(call.route.name)
    ctx = _context(st, comm, call)
    ramp_dense = compressor is not st.compressor and warm_step_goes_dense(
        compressor, sink.wire_bytes(alg, compressor, ctx, comm.world_size, shaped=False),
        sink.wire_bytes(sink.dense, None, ctx, comm.world_size, shaped=False))
    if ramp_dense and call.mbar is not None and switched is None:
        # Adam's momentum space: a dense step of the ramp sends the gradient (AdamW's own step)
        return _dense(st, comm, call, sink, None, "dense (warm-up)", lock=False)
    if call.mbar is not None:
        st.adam.mark(call.params, call.step)
    amax = feed_(st, idx, x, call.div, call.limit, call.mbar, written=call.amax)
    if switched is not None:
        _flush(st, comm, call, switched)
        amax = None
    flag = nonfinite_flag(x, amax)
    if ramp_dense:
        # the lossless end of the ramp: the residual (already in x) goes with it; the velocity
        # goes on; flagged like a compressed step (a NaN resets the memory)
        st.memory.residuals.pop(idx, None)
        return _exchange(st, comm, call, sink, sink.dense, None, flag, ctx, "dense (warm-up)")
    return _exchange(st, comm, call, sink, alg, compressor, flag, ctx, alg.name)


def _switch(st, call: Call) -> str | None:
    """The algorithm this gradient ran before, when the route moves it elsewhere."""
    if not call.route.switches:
        return None
    prev = st.routes.get(call.index)
    st.routes[call.index] = call.route.name
    return prev if prev is not None and prev != call.route.name else None


def _flush(st, comm, call: Call, prev: str) -> None:
    """A switch away from ``prev``: its kept residual goes into ``x`` once; its store is spent."""
    alg = ALGORITHMS.get(prev)
    if alg is not None:
        alg.flush_residual_(call.x, st.algo_store.get(call.index, {}), comm)
    st.algo_store.pop(call.index, None)


def _dense(st, comm, call: Call, sink: Sink, switched: str | None, label: str = DENSE,
           lock: bool = True):
    """The dense route: the local steps where some memory changes (momentum, a switch's flush,
    the drain once dense is the decision), then the dense algorithm.

    Under Adam's momentum space the gradient goes (AdamW's own step, :mod:`comms.core.adam`);
    once dense is the decision, what compression had not delivered yet (in the momentum
    space's coordinates) is dropped, not drained: a drained burst would enter Adam's variance."""
    x, idx = call.x, call.index
    if st.adam is not None:
        call.mbar = None
        if lock and call.route.settled and (switched is not None or idx in st.memory.residuals):
            st.forget(idx)
        elif switched is not None:
            st.algo_store.pop(idx, None)
        switched = None
    drain = st.adam is None and call.route.settled and st.error_feedback and idx in st.memory.residuals
    if not (switched or drain or st.local_transform):
        if call.div != 1:
            x.div_(call.div)  # this rank's share, as torch's hooks divide first (no fp16 overflow)
        return _exchange(st, comm, call, sink, sink.dense, None, None, _context(st, comm, call), label)
    flag = local_flagged(st, idx, x, call.div, call.limit, call.mbar)
    if switched is not None:
        _flush(st, comm, call, switched)
    if drain:
        if idx not in st.memory.draining:
            st.memory.start_drain(idx, DRAIN_STEPS)
        st.memory.drain_step_(idx, x)
    return _exchange(st, comm, call, sink, sink.dense, None, flag, _context(st, comm, call), label)


def _context(st, comm, call: Call) -> Context:
    x = call.x
    return Context(numel=x.numel(), dtype=x.dtype, device=x.device, step=call.step, bucket=call.index,
                   rank=comm.rank, seed=st.seed, shapes=call.shapes)


def _exchange(st, comm, call: Call, sink: Sink, alg, compressor, flag, ctx: Context, label: str):
    """The algorithm's rounds on the fed ``x``, then settle; the sink lands the result."""
    x, idx, world = call.x, call.index, comm.world_size
    record_call(st.stats, idx, x.numel(), x.dtype, x.element_size(), world, label,
                lambda: sink.wire_bytes(alg, compressor, ctx, world), compressor,
                lambda: sink.wire_bytes(sink.dense, None, ctx, world))
    what = sink.what(comm, call, label)
    if compressor is None:  # dense: no residual to settle, no store
        delivery, store, settle = None, {}, _unchanged
    else:
        masking = None if call.mbar is None else st.adam.masking(call.step)
        delivery, store = Delivery(st, compressor, alg, masking), st.store(idx)

        deliver = getattr(call.mbar, "deliver_", None)  # DDP: the aggregate as Adam's momentum

        def settle(result):
            out = settle_(st, idx, x, result[0], result[1], delivery)
            return out if deliver is None else deliver(out)
    more, flag_handle = sink.prepare(comm, call, alg, flag, delivery)
    want = None if delivery is None else delivery.want(st, idx, x, **more)
    try:
        fut = alg(comm, compressor, x, ctx, store) if want is None else alg(comm, compressor, x, ctx, store, want)
    except (RuntimeError, IndexError, OverflowError) as exc:
        # an intermediate round (waited in this thread) failed, or what it handed back does not
        # decode: gloo can return garbage instead of an error once a peer is gone
        raise round_failure(what, exc) from None
    return sink.land(comm, call, alg, fut, flag_handle, settle, what)


def _unchanged(result):
    return result[0]
