"""``MPICommunicator``: the :class:`~comms.transport.communicator.Communicator` interface over mpi4py.

torch wheels ship no MPI process group, so this backend is ours. It works on a ``Dup()`` of
the communicator it is given (our collectives never match the user's messages).

How operations complete
-----------------------
Each operation is started with an MPI *nonblocking* collective (``Iallreduce``,
``Iallgather``, ``Ialltoall``, ``Ireduce_scatter_block``, ``Ibcast``) **in the calling
thread** — so the order in which collectives are started is program order on every rank,
which is what MPI needs to match them. The request is then handed to one progress thread per
communicator, which polls all pending requests with ``Testsome`` (under a lock, so an MPI
built with ``MPI_THREAD_SERIALIZED`` is enough) and completes the ``torch.futures.Future`` of
each finished one *outside* the lock. ``Future.then`` callbacks therefore run on the progress
thread; they may start further collectives (starting only takes the lock briefly), and a
caller blocked in ``fut.wait()`` is released by the progress thread. Nothing ever waits while
holding the lock, so this cannot deadlock with DDP, which waits on hook futures from its own
thread. With ``MPI_THREAD_FUNNELED`` or ``SINGLE`` no second thread may call MPI: operations
then complete synchronously (``Wait`` in the caller) and return finished futures.

Buffers
-------
CPU tensors are passed to MPI directly (as zero-copy NumPy views). CUDA tensors are passed
directly only when the MPI library is CUDA-aware (``MPI.Query_cuda_support()`` where mpi4py
has it, or ``COMMPRESS_MPI_CUDA_AWARE=1``); otherwise they are staged through host memory.
MPI has no bfloat16/float16 reduction, so fp16/bf16 ``all_reduce`` sums in fp32 and rounds
once — deterministic and identical on every rank.

Example::

    >>> from mpi4py import MPI
    >>> from comms.cluster.mpi import MPICommunicator
    >>> comm = MPICommunicator(MPI.COMM_WORLD)
    >>> comm.all_reduce(torch.ones(4)).wait()        # tensor([N, N, N, N])

.. warning::
    Every rank must start the same collectives in the same order (as with any MPI program).
    Call :meth:`MPICommunicator.close` (or let interpreter exit do it) before ``MPI.Finalize``.

Why one module of ~350 lines: the progress thread, the request bookkeeping and the host
staging of CUDA buffers are one mechanism; every collective is a few lines on top of it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref

import torch

from ..transport.communicator import Communicator
from .launch_env import mpi_launched

__all__ = ["MPICommunicator", "cuda_aware", "init_torch_from_mpi", "mpi_env_detected"]

logger = logging.getLogger(__name__)

# torch dtype -> numpy dtype name MPI can reduce; dtypes missing here move as raw bytes
_NP_REDUCIBLE = {
    torch.float32: "float32", torch.float64: "float64", torch.int32: "int32",
    torch.int64: "int64", torch.int8: "int8", torch.uint8: "uint8",
}
_UPCAST_REDUCE = (torch.float16, torch.bfloat16)


def mpi_env_detected() -> bool:
    """True when this process was started by mpirun/mpiexec (see :func:`comms.cluster.launch_env.mpi_launched`)."""
    return mpi_launched()


def cuda_aware() -> bool:
    """Whether CUDA buffers may be handed to MPI directly.

    ``COMMPRESS_MPI_CUDA_AWARE=0/1`` overrides; else ``MPI.Query_cuda_support()`` when
    mpi4py exposes it; else False (staging through host is always correct).
    """
    env = os.environ.get("COMMPRESS_MPI_CUDA_AWARE")
    if env is not None:
        return env.strip().lower() in ("1", "true", "yes", "on")
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is None:
        return False
    try:
        return bool(query())
    except Exception:  # noqa: BLE001 - an MPI without the extension
        return False


class _Pending:
    __slots__ = ("req", "fut", "finish", "keep")

    def __init__(self, req, fut, finish, keep):
        self.req, self.fut, self.finish, self.keep = req, fut, finish, keep


class MPICommunicator(Communicator):
    """Asynchronous collectives over an mpi4py communicator (on a ``Dup()`` of it).

    Args:
        comm: an ``mpi4py.MPI.Comm`` (default ``MPI.COMM_WORLD``); it is duplicated.
        cuda_aware_mpi: pass CUDA buffers directly (``None``: detect, see :func:`cuda_aware`).

    Example::

        >>> state, hook = comms.make_hook("qsgd:bits=8", algorithm="two_phase",
        ...                               communicator=MPICommunicator(MPI.COMM_WORLD))
    """

    backend = "mpi"

    def __init__(self, comm=None, *, cuda_aware_mpi: bool | None = None):
        from mpi4py import MPI

        self._MPI = MPI
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py.MPI.Comm, got {type(comm).__name__}")
        self.comm = base.Dup()
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.cuda_aware = cuda_aware() if cuda_aware_mpi is None else bool(cuda_aware_mpi)
        self.threaded = MPI.Query_thread() >= MPI.THREAD_SERIALIZED
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._pending: list[_Pending] = []
        self._closed = False
        self._thread = None
        if self.threaded:
            self._thread = threading.Thread(target=self._progress, name=f"commpress-mpi-{self.rank}",
                                            daemon=True)
            self._thread.start()
            _LIVE.add(self)

    # -- progress ------------------------------------------------------------------------
    def _progress(self):
        MPI = self._MPI
        idle = 0
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait(timeout=0.5)
                if self._closed and not self._pending:
                    return
                reqs = [p.req for p in self._pending]
                idx = MPI.Request.Testsome(reqs) or []
                done = [self._pending[i] for i in sorted(idx)]
                if done:
                    keep = set(idx)
                    self._pending = [p for i, p in enumerate(self._pending) if i not in keep]
            for p in done:  # outside the lock: callbacks may start new collectives
                self._complete(p)
            if done:
                idle = 0
            else:  # back off from 20 us to 1 ms; Testsome drives MPI progress
                idle = min(idle + 1, 50)
                time.sleep(2e-5 * idle)

    @staticmethod
    def _complete(p: _Pending):
        try:
            value = p.finish()
        except BaseException as exc:  # noqa: BLE001 - forwarded to the waiter
            p.fut.set_exception(exc)
            return
        p.fut.set_result(value)

    def _submit(self, start, finish, keep) -> torch.futures.Future:
        fut = torch.futures.Future()
        if not self.threaded:
            start().Wait()
            self._complete(_Pending(None, fut, finish, keep))
            return fut
        with self._cv:
            if self._closed:
                raise RuntimeError("MPICommunicator is closed")
            req = start()
            self._pending.append(_Pending(req, fut, finish, keep))
            self._cv.notify()
        return fut

    def close(self):
        """Finish pending operations, stop the progress thread and free the duplicate."""
        if self._closed:
            return
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        _LIVE.discard(self)
        try:
            if not self._MPI.Is_finalized():
                self.comm.Free()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass

    # -- buffers -------------------------------------------------------------------------
    def _host(self, t: torch.Tensor):
        """(tensor MPI reads/writes, copy-back target or None)."""
        t = t.detach()
        if t.device.type == "cpu":
            return t.contiguous(), None
        if self.cuda_aware:
            torch.cuda.current_stream(t.device).synchronize()  # MPI is not stream-aware
            return t.contiguous(), None
        return t.to("cpu"), t  # staged: copy back on completion

    def _buf(self, t: torch.Tensor, reduce: bool = False):
        """An mpi4py buffer spec for ``t`` (CPU or CUDA-aware device memory)."""
        MPI = self._MPI
        if t.device.type != "cpu":  # __cuda_array_interface__ / DLPack; MPI type by hand
            if reduce:
                return [t, _MPI_TYPE(MPI, t.dtype)]
            return [t.view(torch.uint8), MPI.BYTE]
        if reduce:
            return t.numpy()
        return t.view(torch.uint8).numpy()  # data movement: raw bytes (any dtype)

    # -- the interface -------------------------------------------------------------------
    def all_reduce(self, t):
        MPI = self._MPI
        if t.dtype in _UPCAST_REDUCE:
            work = t.detach().float()  # fp32 on t's device
        elif t.dtype in _NP_REDUCIBLE:
            work = t
        else:
            raise TypeError(f"MPICommunicator.all_reduce cannot sum dtype {t.dtype}")
        recv, _ = self._host(work)  # summed in place (a host copy when staged or upcast)
        def start():
            return self.comm.Iallreduce(MPI.IN_PLACE, self._buf(recv, reduce=True), op=MPI.SUM)

        def finish():
            if recv.data_ptr() != t.data_ptr():
                t.copy_(recv.to(t.device, t.dtype) if recv.dtype != t.dtype else recv)
            return t

        return self._submit(start, finish, (recv, work))

    def all_gather(self, t):
        src, _ = self._host(t)
        out = torch.empty(self.world_size * t.numel(), dtype=t.dtype, device=src.device)

        def start():
            return self.comm.Iallgather(self._buf(src), self._buf(out))

        return self._submit(start, self._back(out, t.device), (src, out))

    def all_to_all(self, t):
        if t.numel() % self.world_size:
            raise ValueError(f"all_to_all needs numel divisible by world={self.world_size}, got {t.numel()}")
        src, _ = self._host(t)
        out = torch.empty_like(src)

        def start():
            return self.comm.Ialltoall(self._buf(src), self._buf(out))

        return self._submit(start, self._back(out, t.device), (src, out))

    def reduce_scatter(self, t):
        if t.numel() % self.world_size:
            raise ValueError(f"reduce_scatter needs numel divisible by world={self.world_size}, got {t.numel()}")
        MPI = self._MPI
        work = t.detach().float() if t.dtype in _UPCAST_REDUCE else t
        if work.dtype not in _NP_REDUCIBLE:
            raise TypeError(f"MPICommunicator.reduce_scatter cannot sum dtype {t.dtype}")
        src, _ = self._host(work)
        out = torch.empty(t.numel() // self.world_size, dtype=src.dtype, device=src.device)

        def start():
            return self.comm.Ireduce_scatter_block(self._buf(src, reduce=True), self._buf(out, reduce=True),
                                                   op=MPI.SUM)

        def finish():
            return out.to(t.device, t.dtype)

        return self._submit(start, finish, (src, out))

    def broadcast(self, t, src=0):
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src must be in [0, {self.world_size}), got {src}")
        host, back = self._host(t)

        def start():
            return self.comm.Ibcast(self._buf(host), root=src)

        def finish():
            if back is not None:
                back.copy_(host)
            return t

        return self._submit(start, finish, (host,))

    @staticmethod
    def _back(out: torch.Tensor, device: torch.device):
        def finish():
            return out if out.device == device else out.to(device)
        return finish

    def __getstate__(self):
        raise TypeError("MPICommunicator does not pickle (it holds an MPI communicator)")


def _MPI_TYPE(MPI, dtype):
    return {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int32: MPI.INT32_T,
            torch.int64: MPI.INT64_T, torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T}[dtype]


_LIVE: "weakref.WeakSet[MPICommunicator]" = weakref.WeakSet()


@atexit.register
def _close_all():  # registered after mpi4py's own atexit Finalize, so it runs before it
    for c in list(_LIVE):
        c.close()


def init_torch_from_mpi(comm=None, backend: str = "gloo", timeout_s: float = 120.0):
    """Initialize a torch process group from MPI's rank and size (e.g. for DDP under mpirun).

    Rank 0 picks ``MASTER_ADDR`` (env, else its hostname's address) and a free port and
    broadcasts them with mpi4py. Returns ``(rank, world)``.

    Example::

        >>> rank, world = init_torch_from_mpi()      # under ``mpirun -n 2 python train.py``
        >>> model = DDP(model)                       # DDP's own broadcasts use gloo
    """
    import socket
    from datetime import timedelta

    import torch.distributed as dist
    from mpi4py import MPI

    from .launch import free_port

    comm = MPI.COMM_WORLD if comm is None else comm
    rank, world = comm.Get_rank(), comm.Get_size()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    addr = port = None
    if rank == 0:
        addr = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        port = int(os.environ.get("MASTER_PORT") or free_port())
    addr, port = comm.bcast((addr, port), root=0)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    return rank, world
