"""Quantized parameter all-gather for FSDP2 (ZeRO++'s qwZ on torch's ``fully_shard``).

An FSDP2 step moves the parameters twice (the all-gather before forward and again before
backward) and the gradient once; :class:`QuantizedAllGather` is the module's custom
all-gather (``FSDPModule.set_custom_all_gather``): each rank block-quantizes its flat
all-gather input (:class:`compressors.blockquant.BlockQuantizer`: int8 or int4 codes, one
fp32 scale per 256 elements), the payloads are all-gathered, and **every rank decodes every
payload — its own included** into FSDP's all-gather output. So every rank computes with the
same unsharded parameters, bit for bit; the fp32 sharded parameters the optimizer updates
(and a checkpoint saves) are never touched. Quantization is deterministic: the forward and
backward all-gathers of a step see the same values.

Routes per call: ``"full"`` (FSDP's own all-gather, unchanged) or the codec's. ``params=
"auto"`` with ``algorithm="auto"`` times both on each module's first calls and keeps the
faster (one all-reduce of the medians: the same decision on every rank); with a pinned
algorithm ``"auto"`` means int8 in FSDP mode for a lossy gradient compressor, full precision
otherwise (HSDP gathers inside a host; the identity compressor stays bitwise plain FSDP2).
All-gather inputs that are not floating point (float8 / uint8 extensions) always go full.

On the CPU (gloo) the call returns a ``Work`` whose ``wait`` decodes, so a prefetched
all-gather overlaps compute: FSDP's backward prefetch issues the next module's all-gather
before this module's backward. (An explicit forward prefetch of the next module was measured
slower on 2 cores — bench/fsdp_step.py — and is not set.) Elsewhere the call is synchronous
unless FSDP asks for ``async_op``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from compressors.blockquant import BlockQuantizer

from ..algorithms import DENSE
from ..transport.errors import clean_message, failure
from ..transport.waits import BoundedWork, wait, wait_work

try:  # a private path of torch 2.11-2.13: ``import comms`` must not fail where it moved
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError:  # pragma: no cover - FSDP duck-types the comm
    AllGather = object

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["PARAM_MODES", "QuantizedAllGather", "GatherStats", "resolve_params"]

#: ``params=`` values: ``auto`` (see the module docstring), ``full``, ``int8``, ``int4``
PARAM_MODES = ("auto", "full", "int8", "int4")


def resolve_params(params, mode: str, algorithm, lossless: bool) -> str:
    """What ``params=`` means for this state: ``"full"``, ``"int8"``, ``"int4"`` or
    ``"tuned"`` (full or int8 per module, by measured calls)."""
    if params is None:
        params = "auto"
    if not isinstance(params, str) or params not in PARAM_MODES:
        raise ValueError(f"params must be one of {PARAM_MODES}, got {params!r}")
    if params != "auto":
        return params
    if mode != "fsdp" or lossless:
        return "full"
    return "tuned" if algorithm == "auto" else "int8"


@dataclass
class GatherStats:
    """One module's parameter all-gathers: calls, bytes one rank sent and would have sent
    at full precision, seconds of encode and decode."""

    calls: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0
    codec_s: float = 0.0


class QuantizedAllGather(AllGather):
    """The parameter all-gather of one FSDP module (see the module docstring). Built by
    :func:`comms.fsdp.register`; one instance per module.

    Example::

        >>> ag = QuantizedAllGather(state, index=0)
        >>> out = ag.allocate((world * n,), dtype=torch.float32, device="cpu")
        >>> work = ag(out, shard, group)    # None, or a Work: wait() before reading out
    """

    def __init__(self, state, index: int):
        self.state, self.index = state, index

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def _route(self, comm, step: int) -> str:
        """``"full"``, ``"int8"`` or ``"int4"`` for this module's calls at gradient ``step``.

        Tuned per step, never per call: the forward and the backward all-gather of one step
        (and a prefetch of either) take the same route, so a step computes its forward and
        its backward with the same parameters; a decision takes effect at the next step."""
        st, idx = self.state, self.index
        if st.params != "tuned":
            return st.params
        tuner = st.gather_tuner
        if tuner.due(idx, step):
            tuner.decide(idx, comm, f"{st.modules[idx] or '<root>'} parameter all-gather")
        return "int8" if tuner.route(idx, step) != DENSE else "full"

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        st, idx = self.state, self.index
        comm = st.comm_for(group)
        x, out = input_tensor.view(-1), output_tensor.view(-1)
        rec = st.gather_stats.setdefault(idx, GatherStats())
        rec.calls += 1
        # the module's gradient step: its reduce-scatter (end of its backward) counts it up,
        # so the forward and the backward all-gathers of one step share it
        step = st.steps.get(idx, 0)
        route = self._route(comm, step) if x.is_floating_point() else "full"
        codec = st.param_codecs.get(route)  # None: full precision, FSDP's own bytes
        # a call auto times runs synchronously: its transfer belongs to its time
        timed = st.gather_tuner is not None and idx not in st.gather_tuner.decision
        # a Work FSDP waits on later (a prefetch overlaps compute); its wait is ours: bounded
        # by the timeout and raising on a failed transfer
        deferred = not timed and (async_op or x.device.type == "cpu")
        dense = (comm.world_size - 1) * x.numel() * x.element_size()
        rec.dense_bytes += dense
        rec.wire_bytes += dense if codec is None else (comm.world_size - 1) * codec.payload_bytes(x.numel())
        what = st.where(comm, f"FSDP {route} parameter all-gather", idx, x.numel(), x.dtype, step)
        t0 = time.perf_counter()
        try:
            if codec is None:
                work = _all_gather_single(output_tensor, input_tensor, group=group, async_op=True)
                if deferred:
                    return BoundedWork(work, comm.timeout, what)
                wait_work(work, comm.timeout, what)
            else:
                fut = comm.all_gather(codec.encode(x))
                rec.codec_s += time.perf_counter() - t0
                if deferred:
                    # f.value() raises when the transfer failed: the decode never runs on it
                    return BoundedWork(fut.then(lambda f: self._decode(codec, f.value(), out, comm.world_size)),
                                       comm.timeout, what)
                self._decode(codec, wait(fut, comm.timeout, what), out, comm.world_size)
        except (RuntimeError, ValueError) as exc:
            if clean_message(exc).startswith("commpress:"):
                raise
            raise failure(what, exc) from None
        if timed:
            st.gather_tuner.record(idx, step, DENSE if codec is None else "compressed", time.perf_counter() - t0)
        return None

    def _decode(self, codec: BlockQuantizer, recv: torch.Tensor, out: torch.Tensor, world: int) -> None:
        t0 = time.perf_counter()
        codec.decode_into(recv, out, world)
        self.state.gather_stats[self.index].codec_s += time.perf_counter() - t0
