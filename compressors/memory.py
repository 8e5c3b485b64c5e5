"""Memory for the hot paths: fresh payload tensors, a pool that reuses them safely, per-thread
scratch workspaces, and the block/chunk arithmetic of the blocked fast paths.

``comms`` uses these too (the exchange buffers and payload pools of the algorithms).
"""

from __future__ import annotations

import mmap
import threading

import torch

__all__ = ["block_elems", "fresh_empty", "PayloadPool", "Workspace", "numpy_view", "chunk_pieces"]


def block_elems(device: torch.device) -> int:
    """Elements per block of the blocked fast paths (a power of two).

    CPU: 512K elements (2 MiB per fp32 scratch buffer, a few of them: L3-resident); blocks
    must be large enough that torch's per-op dispatch cost (a few microseconds) does not
    dominate: on a 2-core CPU it did at 64K-element blocks, and 256K-1M were within noise.
    Elsewhere (CUDA) blocks are larger still, so that few kernels are launched.
    """
    return 1 << 19 if torch.device(device).type == "cpu" else 1 << 22


_HUGE_MIN_BYTES = 2 << 20  # one transparent huge page
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def fresh_empty(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A new, uninitialised 1-D tensor that nothing else references (payloads, outputs).

    On Linux CPU, tensors of 2 MB and more come from their own anonymous mmap advised for
    transparent huge pages (freed with the tensor), so that the first touch of a fresh payload
    takes a fraction of the page faults of 4 KB pages (a 25 MB payload: ~3 ms instead of
    ~10 ms; 100 MB: ~20 ms instead of ~70 ms, on a 2-core CPU).
    Elsewhere ``torch.empty``.
    """
    nbytes = n * dtype.itemsize
    if (_MADV_HUGEPAGE is None or nbytes < _HUGE_MIN_BYTES
            or torch.device(device).type != "cpu"):
        return torch.empty(n, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(_MADV_HUGEPAGE)
    except OSError:  # pragma: no cover - kernels without THP: plain pages
        pass
    return torch.frombuffer(buf, dtype=dtype, count=n)


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _unreferenced(alias: torch.Tensor) -> bool:
    """True when only ``alias`` (and the temporary storage object of this check) holds its
    storage: no tensor, view, numpy array, DLPack capsule or collective's work object anywhere
    else can still read or write the memory."""
    return _storage_use_count(alias.untyped_storage()._cdata) <= 2


class PayloadPool:
    """Payload tensors that are reused only once nobody references them any more.

    ``compress`` returns fresh tensors (the hook may still be sending the previous step's
    payload while the next one is built). A fresh large payload costs page faults on first
    touch, even with huge pages, so this pool keeps a private alias of each large
    payload it hands out and gives the memory out again only when that alias is the last
    reference to its storage (torch's storage use count: every tensor, view, ``.numpy()``
    array, DLPack export and gloo/NCCL work object holding the payload counts). To the caller
    a payload is indistinguishable from a fresh one. CPU only, >= 2 MB, at most
    ``per_key`` buffers per (size, dtype); without the use-count API it is ``fresh_empty``.
    """

    def __init__(self, per_key: int = 4):
        self.per_key = per_key
        self._lock = threading.Lock()
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def empty(self, n: int, dtype: torch.dtype, device) -> torch.Tensor:
        if (_storage_use_count is None or torch.device(device).type != "cpu"
                or n * dtype.itemsize < _HUGE_MIN_BYTES):
            return fresh_empty(n, dtype, device)
        key = (n, dtype)
        with self._lock:
            aliases = self._free.setdefault(key, [])
            for a in aliases:
                if _unreferenced(a):
                    return a.detach()  # a new tensor object on the same memory
            t = fresh_empty(n, dtype, device)
            if len(aliases) < self.per_key:
                aliases.append(t.detach())
            return t

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    def __reduce__(self):
        return (PayloadPool, (self.per_key,))

    def __deepcopy__(self, memo):
        return PayloadPool(self.per_key)


_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64, torch.int32, torch.int64,
                 torch.int16, torch.uint8, torch.bool)


def numpy_view(t: torch.Tensor):
    """A numpy array sharing ``t``'s memory when ``t`` is a contiguous CPU tensor of a dtype
    numpy has (not bfloat16), else None. Some CPU ops (``>=``, ``nonzero``) are much cheaper
    in numpy on the same memory (per 25M floats in 512K blocks on a 2-core CPU: ``>=`` 1.4 ms
    against torch's 10.7 ms, ``nonzero`` 3.3 ms against 24 ms)."""
    if t.device.type != "cpu" or t.dtype not in _NUMPY_DTYPES or not t.is_contiguous():
        return None
    return t.detach().numpy()


def chunk_pieces(b0: int, b1: int, chunk: int):
    """Split ``[b0, b1)`` at chunk boundaries: yields ``(lo, hi, ci, rows)``.

    ``rows > 0``: ``[lo, hi)`` is ``rows`` whole chunks starting with chunk ``ci`` (view it as
    ``(rows, chunk)``); ``rows == 0``: ``[lo, hi)`` is part of chunk ``ci`` (or a short last chunk).
    """
    pos = b0
    while pos < b1:
        ci, off = divmod(pos, chunk)
        if off == 0 and b1 - pos >= chunk:
            rows = (b1 - pos) // chunk
            yield pos, pos + rows * chunk, ci, rows
            pos += rows * chunk
        else:
            hi = min(b1, (ci + 1) * chunk)
            yield pos, hi, ci, 0
            pos = hi


class Workspace:
    """Scratch buffers reused across calls, so hot paths do not page-fault fresh memory.

    Buffers are per thread (DDP runs future callbacks on backend threads, so two calls on one
    compressor may overlap) and grow to the largest size requested. They never leave the
    compressor: payloads and decoded outputs returned to callers are fresh tensors (or the
    caller's own ``out``). Copying or pickling a compressor gives it an empty workspace.

    .. warning::
        Only CPU buffers are reused. On CUDA one thread runs DDP's future callbacks on
        different streams (each ``then`` callback gets a pool stream), so a reused buffer would
        be written on one stream while a kernel on another still reads it; on an H200 that
        changed the averaged gradient from run to run. torch's caching allocator already
        reuses memory per stream, and a fresh CUDA tensor costs no page faults.
    """

    def __init__(self):
        self._local = threading.local()

    def get(self, name: str, n: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A 1-D buffer of ``n`` elements (contents undefined), reused by later calls on CPU;
        fresh from torch's caching allocator on other devices (see the class warning)."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(max(n, 1), dtype=dtype, device=device)[:n]
        bufs = self._local.__dict__.setdefault("bufs", {})
        key = (name, dtype, device)
        buf = bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=dtype, device=device)
            bufs[key] = buf
        return buf[:n]

    def iota(self, n: int, device) -> torch.Tensor:
        """``arange(n)`` int32, computed once per thread on CPU, then reused (read only); fresh
        on other devices."""
        if torch.device(device).type != "cpu":
            return torch.arange(max(n, 1), dtype=torch.int32, device=device)[:n]
        bufs = self._local.__dict__.setdefault("bufs", {})
        key = ("<iota>", torch.int32, torch.device(device))
        buf = bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.arange(max(n, 1), dtype=torch.int32, device=device)
            bufs[key] = buf
        return buf[:n]

    def clear(self) -> None:
        self._local.__dict__.pop("bufs", None)

    def __reduce__(self):
        return (Workspace, ())

    def __deepcopy__(self, memo):
        return Workspace()

    def __repr__(self) -> str:
        return "Workspace()"
