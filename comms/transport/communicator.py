"""The ``Communicator`` interface and its torch.distributed implementation.

Every operation is asynchronous and returns a ``torch.futures.Future`` whose value is the
output tensor. Tensors are flat and contiguous; ``all_gather`` returns ``world * n``
elements in rank order, ``all_to_all`` exchanges ``world`` equal chunks, ``reduce_scatter``
returns this rank's ``n / world`` chunk of the sum.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from .waits import group_timeout, wait
from .exit_guard import mark_used
from .futures import completed
from .pipelined_exchange import PipelinedExchange, use_pipelined

__all__ = ["Communicator", "TorchCommunicator", "LocalCommunicator", "LoopbackCommunicator",
           "allreduce_max"]

logger = logging.getLogger(__name__)


class Communicator:
    """Asynchronous collectives over a fixed group of ranks (sum is the only reduction)."""

    backend: str = "abstract"
    rank: int
    world_size: int
    # seconds every blocking wait of commpress on this communicator may last (None: unbounded);
    # the process group's timeout for TorchCommunicator (comms.transport.waits)
    timeout: float | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.futures.Future:
        """Sum ``t`` over ranks, in place; the future's value is ``t``."""
        raise NotImplementedError

    def all_gather(self, t: torch.Tensor) -> torch.futures.Future:
        """Concatenate every rank's ``t`` (same numel on all ranks) in rank order."""
        raise NotImplementedError

    def all_to_all(self, t: torch.Tensor) -> torch.futures.Future:
        """Chunk ``j`` of ``t`` goes to rank ``j``; output chunk ``i`` came from rank ``i``."""
        raise NotImplementedError

    def reduce_scatter(self, t: torch.Tensor) -> torch.futures.Future:
        """Sum over ranks and keep this rank's ``1/world`` chunk."""
        raise NotImplementedError

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.futures.Future:
        """Copy ``t`` from group rank ``src`` to all ranks, in place."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend}, rank={self.rank}, world={self.world_size})"


def _then_value(work, value: torch.Tensor) -> torch.futures.Future:
    """The work's future carrying ``value``; a failed collective fails it (``f.value()`` raises:
    a callback that ignored ``f`` would turn a dead peer's error into a successful result)."""
    return work.get_future().then(lambda f: (f.value(), value)[1])


class TorchCommunicator(Communicator):
    """torch.distributed (gloo, nccl) on any process group, ``None`` meaning WORLD.

    The group handle is not pickled (DDP hook states pickle without process groups).

    On gloo, large CPU ``all_gather`` and ``all_to_all`` calls go through
    :class:`~comms.transport.pipelined_exchange.PipelinedExchange` (chunked point-to-point with every
    peer at once: the link rate, where gloo's one-message collectives reach about half of it);
    the rest call torch.distributed directly.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.timeout = group_timeout(group)
        self._exchange: PipelinedExchange | None = None
        mark_used()  # the exit handler gives gloo's threads time to finish (exit_guard)

    def exchange(self) -> PipelinedExchange:
        """This communicator's pipelined point-to-point exchange (one worker thread, made on
        first use)."""
        if self._exchange is None:
            self._exchange = PipelinedExchange(self.group, self.rank, self.world_size)
        return self._exchange

    def all_reduce(self, t):
        return _then_value(dist.all_reduce(t, group=self.group, async_op=True), t)

    def all_gather(self, t):
        if use_pipelined(t, self.backend, self.world_size):
            return self.exchange().all_gather(t)
        out = torch.empty(self.world_size * t.numel(), dtype=t.dtype, device=t.device)
        return _then_value(_all_gather_into(out, t, self.group), out)

    def all_to_all(self, t):
        if t.numel() % self.world_size:
            raise ValueError(f"all_to_all needs numel divisible by world={self.world_size}, got {t.numel()}")
        if use_pipelined(t, self.backend, self.world_size, t.numel() * t.element_size() // self.world_size):
            return self.exchange().all_to_all(t)
        out = torch.empty_like(t)
        return _then_value(dist.all_to_all_single(out, t, group=self.group, async_op=True), out)

    def reduce_scatter(self, t):
        if t.numel() % self.world_size:
            raise ValueError(f"reduce_scatter needs numel divisible by world={self.world_size}, got {t.numel()}")
        n = t.numel() // self.world_size
        if self.backend == "gloo":
            # gloo's reduce_scatter Work has no get_future() in torch 2.13 ("Work::getFuture not
            # implemented"): exchange the chunks with all_to_all and sum them in rank order
            def _sum(fut):
                parts = fut.value().view(self.world_size, n)
                acc = parts[0].clone()
                for r in range(1, self.world_size):
                    acc.add_(parts[r])
                return acc
            return self.all_to_all(t.contiguous()).then(_sum)
        out = torch.empty(n, dtype=t.dtype, device=t.device)
        return _then_value(_reduce_scatter_into(out, t, self.group), out)

    def broadcast(self, t, src=0):
        gsrc = dist.get_global_rank(self.group, src) if self.group is not None else src
        return _then_value(dist.broadcast(t, gsrc, group=self.group, async_op=True), t)


# torch 2.13 prefers *_single names and warns on *_into_tensor / *_tensor; older torch lacks them
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_into(out, t, group):
    return _AG(out, t, group=group, async_op=True)


def _reduce_scatter_into(out, t, group):
    return _RS(out, t, group=group, async_op=True)


class LocalCommunicator(Communicator):
    """A one-rank communicator (every collective is the identity): times compute alone."""

    backend, rank, world_size = "local", 0, 1

    def all_reduce(self, t):
        return completed(t)

    def all_gather(self, t):
        return completed(t.clone())

    def all_to_all(self, t):
        return completed(t.clone())

    def reduce_scatter(self, t):
        return completed(t.clone())

    def broadcast(self, t, src=0):
        return completed(t)


class LoopbackCommunicator(Communicator):
    """``world`` ranks that all hold what this one holds, with nothing on a wire: an
    algorithm run on it does all its CPU work (codec, glue, decode of ``world`` payloads) at
    zero transfer time — the "codec time measured alone" of ``bench/collectives.py``. Every
    collective completes at once: ``all_gather`` repeats ``t`` ``world`` times, ``all_to_all``
    returns a copy, ``reduce_scatter`` this rank's chunk, ``all_reduce`` and ``broadcast``
    leave ``t`` (values are not sums: for timing only)."""

    backend = "loopback"

    def __init__(self, world: int, rank: int = 0):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"LoopbackCommunicator needs 0 <= rank < world, got rank={rank} world={world}")
        self.world_size, self.rank = world, rank

    def all_reduce(self, t):
        return completed(t)

    def all_gather(self, t):
        return completed(t.repeat(self.world_size))

    def all_to_all(self, t):
        return completed(t.clone())

    def reduce_scatter(self, t):
        n = t.numel() // self.world_size
        return completed(t[self.rank * n:(self.rank + 1) * n].clone())

    def broadcast(self, t, src=0):
        return completed(t)


def allreduce_max(comm: Communicator, t: torch.Tensor, what: str = "commpress: MAX allgather") -> torch.Tensor:
    """MAX over ranks with the sum-only interface: allgather, then max (exact in any order).
    Blocks (at most ``comm.timeout``): for set-up and tuning, never the hook's hot path."""
    g = wait(comm.all_gather(t), comm.timeout, what)
    return g.view(comm.world_size, -1).amax(0)
