"""FSDP's own collectives, unchanged but bounded: commpress waits on them with the timeout.

:class:`BoundedReduceScatter` issues exactly FSDP's reduce-scatter (the same call, op and
group: the same bits) and :class:`BoundedReplicateAllReduce` exactly native HSDP's replicate
all-reduce (``AVG`` over the replicate group, as torch's 2-D HSDP issues it). Each waits with
:func:`~comms.transport.waits.wait_work`: a stopped or dead peer makes this rank raise within
the timeout, naming the module, step and peer, instead of waiting in gloo past the process
group's timeout while the other survivors have raised. They carry HSDP's intra-shard
reduce-scatter under every compressor, and the whole gradient sync of the ``identity``
compressor with nothing to do locally — which therefore trains bitwise as plain FSDP2 and
native HSDP do, at any world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..algorithms import DENSE
from ..core.stats import record_call
from ..transport.errors import clean_message, failure
from ..transport.waits import BoundedWork, wait_work

try:  # a private path of torch 2.11-2.13: ``import comms`` must not fail where it moved
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - FSDP duck-types the comm
    ReduceScatter = object

__all__ = ["BoundedReduceScatter", "BoundedReplicateAllReduce"]

# torch 2.13 renamed reduce_scatter_tensor (deprecated there) to reduce_scatter_single
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _bounded(state, index: int, comm, label: str, x: torch.Tensor, issue, async_op: bool = False):
    """Issue ``issue()`` (a Work) and wait for it within the timeout, errors named."""
    what = state.where(comm, label, index, x.numel(), x.dtype, state.steps.get(index, 0))
    try:
        work = issue()
        if async_op:
            return BoundedWork(work, comm.timeout, what)
        wait_work(work, comm.timeout, what)
    except RuntimeError as exc:
        if clean_message(exc).startswith("commpress:"):
            raise
        raise failure(what, exc) from None
    return None


class BoundedReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter of one module, bounded (see the module docstring). ``counts``:
    this call is the module's whole gradient sync (the identity compressor's FSDP mode): it
    runs the per-step checks, counts the step and the bytes.

    Example::

        >>> module.set_custom_reduce_scatter(BoundedReduceScatter(state, index=0))
    """

    def __init__(self, state, index: int, counts: bool = False):
        self.state, self.index, self.counts = state, index, counts

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        st, idx = self.state, self.index
        comm = st.comm_for(group)
        if self.counts:
            _begin(st, idx, comm, input_tensor.view(-1), (comm.world_size - 1) * output_tensor.numel())
        out = _bounded(st, idx, comm, "FSDP reduce-scatter", input_tensor,
                       lambda: _reduce_scatter_single(output_tensor, input_tensor, group=group, op=op,
                                                      async_op=True), async_op)
        if self.counts:
            st.steps[idx] = st.steps.get(idx, 0) + 1
        return out


class BoundedReplicateAllReduce:
    """Native HSDP's replicate all-reduce of one module's shard (``AVG``), bounded: the whole
    replicate step of the identity compressor in HSDP mode (see the module docstring).

    Example::

        >>> module.set_all_reduce_hook(BoundedReplicateAllReduce(state, index=0))
    """

    def __init__(self, state, index: int):
        self.state, self.index = state, index

    def __call__(self, reduce_output: torch.Tensor) -> None:
        st, idx = self.state, self.index
        comm = st.comm_for(st.replicate_group)
        x = reduce_output.view(-1)
        _begin(st, idx, comm, x, None)
        if comm.world_size > 1:
            _bounded(st, idx, comm, "HSDP replicate all-reduce", x,
                     lambda: dist.all_reduce(reduce_output, op=dist.ReduceOp.AVG,
                                             group=st.replicate_group, async_op=True))
        st.steps[idx] = st.steps.get(idx, 0) + 1


def _begin(st, idx: int, comm, x: torch.Tensor, nbytes) -> None:
    """The per-step checks (configuration, replica guard) and the call's bytes."""
    st.begin(idx, comm, x)
    es, world = x.element_size(), comm.world_size
    record_call(st.stats, idx, x.numel(), x.dtype, es, world, DENSE, None, None,
                None if nbytes is None else (lambda: nbytes * es))
