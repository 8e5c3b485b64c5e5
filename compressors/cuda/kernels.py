"""Python launchers of the ``csrc/`` kernels, with the torch reference's signatures and outputs.

Each function takes contiguous CUDA tensors, allocates its outputs with torch (the caching
allocator, on the current stream) and returns what the torch reference returns, bit for bit:

=====================================  ==============================================
launcher                               torch reference
=====================================  ==============================================
:func:`chunk_absmax`                   ``compressors.qsgd.chunk_absmax``
:func:`qsgd_compress`                  ``QSGD.compress`` (payload ``[scales, packed]``)
:func:`qsgd_decompress`                ``QSGD.decompress`` (+ fused ``acc +=`` form)
:func:`pack` / :func:`unpack`          ``compressors.bitpack.pack`` / ``unpack``
:func:`sign_pack` / :func:`sign_decompress`  ``ScaledSign`` bits / decode
:func:`topk_compact`                   ``torch.nonzero(x.abs() >= thr)`` (unordered, capped)
:func:`scatter_add_`                   ``acc.index_add_(0, idx, vals)``
:func:`shared_scale_encode` / ``_decode``  ``comms/algorithms/shared_scale.py`` steps 2-3
:func:`two_phase_qsgd_owner`           ``two_phase`` owner step for QSGD payloads
=====================================  ==============================================

Example::

    >>> from compressors.cuda import kernels
    >>> scales, packed = kernels.qsgd_compress(x_cuda, bits=4, chunk=2048, key=key)

Launches go through a backend with ``compressors.cuda.loader``'s interface (``BLOCK``,
``grid_for``, ``launch``, ``static_shared_bytes``): the loader (CuPy) by default; the CPU
emulator of ``tests/emu`` plugs in with :func:`set_backend`, so the tests drive the kernels
with exactly the arguments and launch shapes computed here.

.. warning::
    No argument checking beyond what the kernels need to stay in bounds: callers
    (``compressors/cuda/dispatch.py``) validate. Tensors must be contiguous CUDA tensors.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from . import loader

__all__ = [
    "DTYPE_CODE", "chunk_absmax", "qsgd_compress", "qsgd_decompress", "pack", "unpack",
    "sign_pack", "sign_decompress", "topk_compact", "scatter_add_", "shared_scale_encode",
    "shared_scale_decode", "two_phase_qsgd_owner", "two_phase_shared_mem", "two_phase_fits",
    "set_backend", "get_backend",
]

logger = logging.getLogger(__name__)

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# static + dynamic shared memory of one block without an opt-in attribute
# (cudaFuncAttributeMaxDynamicSharedMemorySize); a launch above it fails
_SHARED_MEM_LIMIT = 48 * 1024

_backend = loader  # see set_backend


def set_backend(backend=None):
    """Route every launch of this module to ``backend`` (an object with ``BLOCK``,
    ``grid_for(work_items, index)``, ``launch(name, index, grid, args, shared_mem=0)`` and
    ``static_shared_bytes(name, index)``, like :mod:`compressors.cuda.loader`); ``None``
    restores the loader. Returns the previous backend. For tests: not thread-safe."""
    global _backend
    prev, _backend = _backend, (loader if backend is None else backend)
    return prev


def get_backend():
    """The backend launches go to (:mod:`compressors.cuda.loader` unless set otherwise)."""
    return _backend


def _i64(v):
    return np.int64(v)


def _dev(t: torch.Tensor) -> int:
    if t.device.index is not None:
        return t.device.index
    # CPU tensors reach here only through a CPU backend (the emulator): device index 0
    return torch.cuda.current_device() if t.is_cuda else 0


def _chunk_block(chunk: int) -> int:
    """Threads per block of the one-block-per-chunk kernels: one per group of 8 elements of a
    chunk, a power of two from 32 to ``BLOCK`` (a 256-element chunk gets one warp, not 256
    threads of which 224 idle); longer chunks give each thread several groups."""
    need = -(-chunk // 8)
    return max(32, min(_backend.BLOCK, 1 << max(0, need - 1).bit_length()))


def _chunk_launch(name, idx, nch, chunk, args, shared_mem=0):
    block = _chunk_block(chunk)
    # up to 2048 resident threads per SM, at most 32 blocks: grid-stride over the chunks past that
    grid = min(nch, _backend.grid_for(nch * block, idx, per_block=block, blocks_per_sm=min(32, 2048 // block)))
    extra = {"block": block} if block != _backend.BLOCK else {}  # backends without the argument still work
    _backend.launch(name, idx, grid, args, shared_mem=shared_mem, **extra)


def _groups(n: int) -> int:
    # the vectorised kernels give each thread groups of 8 consecutive elements
    return -(-n // 8)


def _packed_nbytes(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def _packed_buffer(n: int, bits: int, device) -> torch.Tensor:
    # the kernels store whole 32-bit words: allocate a 4-byte aligned buffer
    return torch.empty(_packed_nbytes(n, bits), dtype=torch.uint8, device=device)


def chunk_absmax(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """fp32 max|x| per chunk (NaN propagates)."""
    n, idx = x.numel(), _dev(x)
    nch = -(-n // chunk)
    out = torch.empty(nch, dtype=torch.float32, device=x.device)
    if nch:
        _backend.launch("chunk_absmax", idx, min(nch, _backend.grid_for(nch * _backend.BLOCK, idx)),
                      (x, np.int32(DTYPE_CODE[x.dtype]), _i64(n), _i64(chunk), _i64(nch), out))
    return out


def qsgd_compress(x: torch.Tensor, bits: int, chunk: int, key: int) -> list[torch.Tensor]:
    """``[scales (nchunks fp32), packed codes]`` of QSGD with hash stream ``key``."""
    n, idx = x.numel(), _dev(x)
    nch = -(-n // chunk)
    scales = torch.empty(nch, dtype=torch.float32, device=x.device)
    packed = _packed_buffer(n, bits, x.device)
    if n == 0:
        return [scales, packed]
    dt, nb = np.int32(DTYPE_CODE[x.dtype]), _i64(packed.numel())
    if chunk % 8 == 0:
        # one read of x: one block per chunk, groups of 8 in registers, aligned code stores
        _chunk_launch("qsgd_encode_chunks", idx, nch, chunk,
                      (x, dt, _i64(n), _i64(chunk), _i64(nch), np.int32(bits), np.uint32(key), scales, packed, nb))
    elif (chunk * bits) % 32 == 0 and packed.data_ptr() % 4 == 0:
        # one block per chunk: each chunk owns whole words of the packed stream
        _backend.launch("qsgd_quantize_fused", idx, min(nch, _backend.grid_for(nch * _backend.BLOCK, idx)),
                      (x, dt, _i64(n), _i64(chunk), _i64(nch), np.int32(bits), np.uint32(key),
                       scales, packed, nb))
    else:
        _backend.launch("chunk_absmax", idx, min(nch, _backend.grid_for(nch * _backend.BLOCK, idx)),
                      (x, dt, _i64(n), _i64(chunk), _i64(nch), scales))
        _backend.launch("qsgd_quantize_packed", idx, _backend.grid_for(n, idx),
                      (x, dt, _i64(n), _i64(chunk), np.int32(bits), np.uint32(key), scales, packed, nb))
    return [scales, packed]


def _decode_target(acc, out, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Where a decode kernel writes: ``acc`` (adds), else ``out``, else a fresh tensor."""
    if acc is not None:
        return acc
    return out if out is not None else torch.empty(n, dtype=dtype, device=device)


def qsgd_decompress(scales: torch.Tensor, packed: torch.Tensor, bits: int, chunk: int, n: int,
                    dtype: torch.dtype, acc: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode ``n`` elements to ``dtype``; with ``acc`` (fp32), ``acc += decode`` in place; with
    ``out`` (``dtype``, ``n``), the decode written into it."""
    idx = _dev(packed)
    out = _decode_target(acc, out, n, dtype, packed.device)
    if n:
        _backend.launch("qsgd_dequantize", idx, _backend.grid_for(_groups(n), idx),
                      (packed, scales, _i64(n), _i64(chunk), np.int32(bits), out,
                       np.int32(DTYPE_CODE[out.dtype]), np.int32(acc is not None)))
    return out


def pack(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None, ws=None) -> torch.Tensor:
    """Pack uint8 codes (``bitpack.pack`` layout) into ``out`` (any alignment) or a new buffer."""
    n, idx = codes.numel(), _dev(codes)
    if out is None:
        out = _packed_buffer(n, bits, codes.device)
    if n:
        _backend.launch("pack_bits", idx, _backend.grid_for(_groups(n), idx),
                      (codes, _i64(n), np.int32(bits), out, _i64(_packed_nbytes(n, bits))))
    return out


def unpack(packed: torch.Tensor, bits: int, n: int, out: torch.Tensor | None = None,
           ws=None) -> torch.Tensor:
    """Inverse of :func:`pack`: ``n`` uint8 codes."""
    idx = _dev(packed)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    if n:
        _backend.launch("unpack_bits", idx, _backend.grid_for(_groups(n), idx), (packed, _i64(n), np.int32(bits), out))
    return out


def sign_pack(x: torch.Tensor) -> torch.Tensor:
    """``pack((x >= 0).to(uint8), 1)`` in one pass."""
    n, idx = x.numel(), _dev(x)
    out = _packed_buffer(n, 1, x.device)
    if n:
        _backend.launch("sign_pack", idx, _backend.grid_for(n if x.data_ptr() % 16 else _groups(n), idx),
                      (x, np.int32(DTYPE_CODE[x.dtype]), _i64(n), out, _i64(out.numel())))
    return out


def sign_decompress(scales: torch.Tensor, packed: torch.Tensor, chunk: int, n: int,
                    dtype: torch.dtype, acc: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``+s`` / ``-s`` per bit in ``dtype``; with ``acc`` (fp32), ``acc += decode``; with
    ``out`` (``dtype``, ``n``), the decode written into it."""
    idx = _dev(packed)
    out = _decode_target(acc, out, n, dtype, packed.device)
    if n:
        _backend.launch("sign_decode", idx, _backend.grid_for(_groups(n), idx),
                      (packed, scales, _i64(n), _i64(chunk), out, np.int32(DTYPE_CODE[out.dtype]),
                       np.int32(acc is not None)))
    return out


def topk_compact(x: torch.Tensor, thr: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots (cap int32), count (1 int32))``: indices with ``|x| >= thr`` in arbitrary order.

    ``count`` may exceed ``cap``; only the first ``min(count, cap)`` slots are written.
    """
    n, idx = x.numel(), _dev(x)
    slots = torch.empty(max(cap, 1), dtype=torch.int32, device=x.device)
    count = torch.zeros(1, dtype=torch.int32, device=x.device)
    if n:
        _backend.launch("topk_compact", idx, _backend.grid_for(_groups(n), idx),
                      (x, np.int32(DTYPE_CODE[x.dtype]), _i64(n), thr.reshape(1), slots,
                       np.uint32(cap), count))
    return slots, count


def scatter_add_(acc: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """``acc.index_add_(0, idx, vals)`` for fp32 ``acc``, int32 ``idx`` (distinct but zero pads)."""
    k, dev = idx.numel(), _dev(acc)
    if k:
        _backend.launch("topk_scatter_add", dev, _backend.grid_for(k, dev),
                      (vals, np.int32(DTYPE_CODE[vals.dtype]), idx, _i64(k), acc, _i64(acc.numel())))
    return acc


def shared_scale_encode(x: torch.Tensor, chunk: int, inv: torch.Tensor, step: torch.Tensor,
                        levels: int, key: int, wire_dtype: torch.dtype,
                        own_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(q (wire_dtype), own (own_dtype) or None)`` of the shared-scale quantization."""
    n, idx = x.numel(), _dev(x)
    q = torch.empty(n, dtype=wire_dtype, device=x.device)
    own = None if own_dtype is None else torch.empty(n, dtype=own_dtype, device=x.device)
    if n:
        _backend.launch("shared_scale_encode", idx, _backend.grid_for(_groups(n), idx),
                      (x, np.int32(DTYPE_CODE[x.dtype]), _i64(n), _i64(chunk), inv, step,
                       np.float32(levels), np.uint32(key), q, np.int32(wire_dtype == torch.int32),
                       own, np.int32(DTYPE_CODE[own_dtype] if own_dtype is not None else 0)))
    return q, own


def shared_scale_decode(q: torch.Tensor, chunk: int, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(float(q) * step[chunk]).to(dtype)`` for the summed wire integers."""
    n, idx = q.numel(), _dev(q)
    out = torch.empty(n, dtype=dtype, device=q.device)
    if n:
        _backend.launch("shared_scale_decode", idx, _backend.grid_for(_groups(n), idx),
                      (q, np.int32(q.dtype == torch.int32), _i64(n), _i64(chunk), step, out,
                       np.int32(DTYPE_CODE[dtype])))
    return out


def two_phase_shared_mem(chunk: int, world: int) -> int:
    """Dynamic shared memory of :func:`two_phase_qsgd_owner`: the senders' scale and step per
    rank (the owner sum stays in registers, so ``chunk`` does not count)."""
    return 8 * world


def two_phase_fits(chunk: int, world: int, index: int) -> bool:
    """True when :func:`two_phase_qsgd_owner`'s block fits the 48 KiB a launch gets without an
    opt-in attribute: the dynamic part (:func:`two_phase_shared_mem`) PLUS the kernel's static
    shared memory (``block_reduce_max_nan``'s slots, 144 B on current GPUs) as the compiled
    kernel reports it (a launch over the limit fails with no torch fallback)."""
    static = _backend.static_shared_bytes("two_phase_qsgd_owner", index)
    return two_phase_shared_mem(chunk, world) + static <= _SHARED_MEM_LIMIT


def two_phase_qsgd_owner(recv: torch.Tensor, world: int, m: int, bits: int, chunk: int, key: int,
                         residual_in: torch.Tensor | None = None,
                         residual_out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Owner step of two-phase QSGD: decode-sum ``world`` wire payloads, re-quantize.

    Returns the owner payload ``[scales, packed]``; writes ``residual_out = y - decode`` when
    given. Needs ``chunk % 8 == 0`` and :func:`two_phase_fits`.
    """
    idx = _dev(recv)
    nch = -(-m // chunk)
    seg = recv.numel() // world
    scales = torch.empty(nch, dtype=torch.float32, device=recv.device)
    packed = _packed_buffer(m, bits, recv.device)
    if m:
        _chunk_launch("two_phase_qsgd_owner", idx, nch, chunk,
                      (recv, _i64(seg), np.int32(world), _i64(m), _i64(chunk), _i64(nch), np.int32(bits),
                       np.uint32(key), residual_in, residual_out, scales, packed, _i64(packed.numel())),
                      shared_mem=two_phase_shared_mem(chunk, world))
    return [scales, packed]
