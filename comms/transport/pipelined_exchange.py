"""Pipelined point-to-point exchange: gloo allgather and all_to_all at the link rate.

gloo's ``all_gather_into_tensor`` and ``all_to_all_single`` move a large buffer as one
message per peer, and on a shaped 1 Gb/s link that runs at about half the link rate
(measured on netsim, 2 ranks, 25 MB per rank: allgather 416 ms, all_to_all 396 ms, one
isend/irecv pair per peer 412 ms, where the link allows 200 ms and gloo's own allreduce of
the same bytes takes 213 ms). Cutting the buffer into 1 MiB chunks and exchanging them with
every peer at once, one chunk in flight per peer (post the sends and receives of chunk c, wait
for them, go on), runs at the link rate: 209 ms (window 2-4 or 256 KiB-4 MiB chunks measured
within 10% of it; 1 MiB, window 1 was the best). **Two chunks are in flight**
(:data:`WINDOW`): post chunk c+1 before waiting for chunk c, so the link does not idle while
the worker thread turns around. Measured on netsim, 2 ranks, four schedules interleaved in one
run, 15 exchanges each, window 1 -> 2: at 1 Gb/s the allgather's
median went 243 -> 227 ms at 25 MB per rank (gloo's allreduce of the same wire bytes: 219 ms),
129 -> 122 ms at 13 MB, 83 -> 76 ms at 8 MB; at 10 Gb/s 31.5 -> 28.0 ms at 13 MB, 22.6 -> 18.6
ms at 8 MB, 47.4 -> 47.2 at 25 MB; all_to_all at 1 Gb/s 274 -> 258 ms (25 MB). Window 4 and
2 MiB chunks ran within noise of window 2 or slower at 1 Gb/s (25 MB: 240 / 234 ms). At 4
ranks with 8 MB per rank (every peer at once, 24 MB up per rank: 192 ms at the link rate) the
same exchange took 222 ms against gloo's allgather 325 ms. (The rows of
``bench/collectives.py --transport`` repeat these measurements.)

gloo's point-to-point ``Work`` has no ``get_future()``, so the exchange runs on one worker
thread per communicator, in the order the caller issued the exchanges (the same order on
every rank: every rank posts its chunks in the same order and matches them by tag), and
completes a ``torch.futures.Future``. Its waits are bounded by the process group's timeout
(gloo raises in ``wait``), and the exception reaches the future, so a stuck or dead peer
surfaces as an error of the collective, never a hang.

Used by :class:`comms.transport.communicator.TorchCommunicator` for CPU tensors on gloo with
``2 <= world <= MAX_WORLD`` and payloads of at least
``MIN_BYTES`` per rank (below that a message is latency-bound and gloo's one-call collective
is as fast). Every rank takes the same path: the choice depends on the numel, dtype and world
only, which allgather and all_to_all require to match.

``MAX_WORLD = 2`` by measurement: at 4 ranks (netsim 1 Gb/s, the 4 ranks on 2 shared cores)
the every-peer-at-once exchange won with 8 MB per rank (222 vs 325 ms) and lost with 26 MB per
rank (allgather 1068 vs gloo's 830 ms; all_to_all 270 vs 262), so beyond 2 ranks gloo's own
collectives are kept until a schedule (ring, or fewer peers at once) measures better.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref

import torch
import torch.distributed as dist

from compressors.memory import PayloadPool

__all__ = ["PipelinedExchange", "use_pipelined", "CHUNK_BYTES", "WINDOW", "MIN_BYTES", "MAX_WORLD"]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # the measured best of 256 KiB, 1 MiB, 4 MiB (window 1)
WINDOW = 2  # chunks in flight per peer (see the module docstring; < 256: tags stay distinct)
MIN_BYTES = 512 << 10  # per rank; 2 MB per rank measured 26 ms pipelined vs 28.5 ms gloo allgather
MAX_WORLD = 2  # see the module docstring
_TAG_BASE = 0x3C000000  # apart from other point-to-point users of the group
_STOP = object()
_LIVE: "weakref.WeakSet[PipelinedExchange]" = weakref.WeakSet()


def use_pipelined(t: torch.Tensor, backend: str, world: int, nbytes: int | None = None) -> bool:
    """Whether an exchange of ``t`` (``nbytes`` per rank, default ``t``'s bytes) goes through
    :class:`PipelinedExchange` (a function of values equal on every rank)."""
    n = t.numel() * t.element_size() if nbytes is None else nbytes
    return (backend == "gloo" and t.device.type == "cpu" and 2 <= world <= MAX_WORLD
            and n >= MIN_BYTES)


class PipelinedExchange:
    """Chunked, every-peer-at-once point-to-point exchange on one worker thread.

    Args:
        group: the process group (``None``: WORLD); gloo.
        rank, world: this rank's group rank and the group size.
    """

    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self._global = [dist.get_global_rank(group, r) if group is not None else r
                        for r in range(world)]
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._seq = 0
        # outputs reused once unreferenced: a fresh world-sized output page-faults every call
        self._pool = PayloadPool(per_key=8)
        # the worker holds the queue and the group, never the exchange itself: once the
        # exchange is unreachable (its communicator and hook state dropped) the finalizer ends
        # the worker and the pool is freed. (A worker holding `self` leaked every exchange's
        # pool: 12 GB after ~150 registrations in one process in bench/autotune.py.)
        weakref.finalize(self, self._jobs.put, _STOP)

    def all_gather(self, t: torch.Tensor) -> torch.futures.Future:
        """Every rank's ``t`` concatenated in rank order (``world * numel`` elements)."""
        t = t.contiguous()
        out = self._pool.empty(self.world * t.numel(), t.dtype, "cpu")
        out[self.rank * t.numel():(self.rank + 1) * t.numel()].copy_(t)
        src, dst = _bytes(t), _bytes(out).view(self.world, -1)
        pairs = [(p, src, dst[p]) for p in self._peers()]
        return self._submit(pairs, out)

    def all_to_all(self, t: torch.Tensor) -> torch.futures.Future:
        """Chunk ``j`` of ``t`` to rank ``j``; output chunk ``i`` from rank ``i``."""
        t = t.contiguous()
        out = self._pool.empty(t.numel(), t.dtype, "cpu")
        n = t.numel() // self.world
        out[self.rank * n:(self.rank + 1) * n].copy_(t[self.rank * n:(self.rank + 1) * n])
        src, dst = _bytes(t).view(self.world, -1), _bytes(out).view(self.world, -1)
        pairs = [(p, src[p], dst[p]) for p in self._peers()]
        return self._submit(pairs, out)

    def _peers(self) -> list[int]:
        # peer k steps away on both sides: rank r sends to r+k while r+k sends to r+2k, so every
        # link carries one flow each way per step (the order every rank posts in)
        return [(self.rank + k) % self.world for k in range(1, self.world)]

    def _submit(self, pairs, out) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            seq = self._seq
            self._seq += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=_serve, args=(self._jobs, (self.group, list(self._global))),
                                                name="commpress-exchange", daemon=True)
                self._thread.start()
                _LIVE.add(self)
        self._jobs.put((seq, pairs, out, fut))
        return fut

    def stop(self) -> None:
        """End the worker after the exchanges already queued (at interpreter exit)."""
        th = self._thread
        if th is not None and th.is_alive():
            self._jobs.put(_STOP)
            th.join(timeout=1.0)

    def __getstate__(self):
        raise TypeError("PipelinedExchange holds a process group and a thread; it does not pickle")


def _serve(jobs: queue.SimpleQueue, where: tuple) -> None:
    """The worker: exchanges in issue order until :data:`_STOP`."""
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        seq, pairs, out, fut = job
        try:
            _exchange(where, seq, pairs)
        except Exception as exc:  # noqa: BLE001 - delivered to the caller's future
            fut.set_exception(exc)
            continue
        fut.set_result(out)
        del job, pairs, out, fut  # do not hold the last output while waiting for the next job


def _exchange(where: tuple, seq: int, pairs) -> None:
    group, global_ranks = where
    length = max((s.numel() for _, s, _ in pairs), default=0)
    in_flight: list[list] = []  # per chunk posted and not yet waited for: its works
    for c, a in enumerate(range(0, length, CHUNK_BYTES)):
        b = min(length, a + CHUNK_BYTES)
        tag = _TAG_BASE | (seq & 0xFFFF) << 8 | (c & 0xFF)  # WINDOW < 256: no reuse in flight
        works = []
        for peer, send, recv in pairs:
            g = global_ranks[peer]
            works.append(dist.isend(send[a:b], g, group=group, tag=tag))
            works.append(dist.irecv(recv[a:b], g, group=group, tag=tag))
        in_flight.append(works)
        if len(in_flight) >= WINDOW:
            for w in in_flight.pop(0):
                w.wait()
    for works in in_flight:
        for w in works:
            w.wait()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@atexit.register
def _stop_all() -> None:  # no thread may call into torch while its C++ objects are torn down
    for ex in list(_LIVE):
        ex.stop()
