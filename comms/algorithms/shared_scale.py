"""``shared_scale``: integer allreduce with one scale per chunk shared by every rank.

The SwitchML / THC idea, for compressors of the ``"shared_scale"`` family (QSGD: its
``bits`` choose the per-rank levels, its ``chunk`` the scale granularity):

1. all-gather the per-chunk max-abs of ``x`` (a tiny message) and take the max over ranks —
   max is exact, so every rank holds the same scale ``s`` per chunk (an all_gather instead of
   a MAX allreduce keeps the :class:`~comms.transport.communicator.Communicator` interface sum-only);
2. every rank quantizes with that shared scale to integers ``q = floor(x L / s + u)`` in
   ``[-L, L]``, ``u`` uniform from a private (rank-mixed) hash-RNG stream, so ``E[q] = x L / s``
   (unbiased stochastic rounding);
3. one integer allreduce sums the ``q`` exactly; every rank decodes ``sum(q) * s / L`` once.

Overflow argument: ``|x| <= s`` per chunk on every rank (``s`` is the max over ranks), so
``|x L / s| <= L`` and, after the clamp that absorbs fp rounding, ``|q| <= L``; the sum of
``W`` ranks is at most ``W L``. Choosing ``L <= floor((2^(w-1) - 1) / W)`` for a ``w``-bit
signed wire integer keeps ``|sum| <= 2^(w-1) - 1``: it can never wrap. gloo and NCCL sum int8
and int32 but not int16, so the wire is int8 while that leaves at least
``min(2^(bits-1) - 1, MIN_INT8_LEVELS)`` levels, and int32 (no saving against fp32) beyond —
see :func:`shared_scale_levels`. The choice is recorded in ``store["shared_scale_levels"]``
as ``[L, wire bits]``.

Integer sums are exact and associative, so every rank decodes the same bits whatever the
backend's summation order. Bytes sent per rank: ``16 (W-1)`` (layout header) ``+ 4 nchunks
(W-1)`` (scales) ``+ 2 (W-1)/W * n * wire itemsize``.

Example::

    >>> state = comms.register(ddp_model, "qsgd:bits=8", algorithm="shared_scale")
"""

from __future__ import annotations

import logging

import torch

from compressors import cpu_kernels
from compressors.hashrng import stream_key, uniform_into

from . import buffers, cuda_kernels as cuda_dispatch
from ..transport.futures import when_all
from .base import Algorithm, PLAIN, Want, round_wait
from .layout_check import HEADER_BYTES, check_same_layout

__all__ = ["SharedScale", "shared_scale", "shared_scale_levels", "shared_scale_error_bound",
           "quantize_reference", "decode_reference", "quantize_cpu", "decode_cpu", "part_bounds", "MIN_INT8_LEVELS",
           "PART_BYTES"]

logger = logging.getLogger(__name__)

PART_BYTES = 4 << 20  # wire bytes per pipelined part (see part_bounds; chosen by measurement)
MIN_INT8_LEVELS = 7  # fewer int8 levels than this: widen the wire integer to int32
_STREAM_SALT = 0x51A7E5CA  # keeps this stream apart from the compressor's own streams


def shared_scale_levels(bits: int, world: int) -> tuple[int, torch.dtype]:
    """``(L, wire dtype)``: levels per side and the integer that carries their sum.

    Example::

        >>> shared_scale_levels(8, 2)
        (63, torch.int8)
        >>> shared_scale_levels(8, 32)
        (127, torch.int32)
    """
    target = max(1, (1 << (bits - 1)) - 1)
    l8 = 127 // world
    if l8 >= min(target, MIN_INT8_LEVELS):
        return min(target, l8), torch.int8
    return min(target, (2 ** 31 - 1) // world), torch.int32


def _per_chunk_(t: torch.Tensor, per_chunk: torch.Tensor, chunk: int, op: str) -> torch.Tensor:
    """``t[i] (op)= per_chunk[i // chunk]`` in place without a per-element expansion."""
    n = t.numel()
    nfull = n // chunk
    if nfull:
        getattr(t[: nfull * chunk].view(nfull, chunk), op)(per_chunk[:nfull, None])
    if n > nfull * chunk:
        getattr(t[nfull * chunk:], op)(per_chunk[nfull])
    return t


def quantize_reference(xf, chunk, scales, levels, wire_dtype, key):
    """Step 2 in torch ops (the oracle of csrc/shared_scale.cu): ``(q, t, step)`` with
    ``q = t.to(wire_dtype)``, ``t`` the fp32 integers (``own = t * step``) and ``step = s / L``.

    ``t = clamp(floor(fl(fl(x * inv) + u)), -L, L)`` with ``inv = L / s`` (0 where ``s`` is
    not > 0), and a NaN ``t`` becomes 0. NaN arises from a NaN or infinite ``x`` (``x * 0``)
    and from an exact zero in a chunk whose shared scale is so small that ``inv`` overflows to
    inf (``0 * inf``): 0 is then the right integer (and the one the int8 cast happened to give,
    where an int32 cast of NaN gives INT_MIN and wraps the sum); the kernel does the same.
    """
    n = xf.numel()
    inv = torch.where(scales > 0, levels / scales, torch.zeros_like(scales))  # fp32 L/s
    step = scales / levels  # decode step: identical fp32 on every rank
    t = torch.empty(n, dtype=torch.float32, device=xf.device)
    t.copy_(xf)
    _per_chunk_(t, inv, chunk, "mul_")
    u = torch.empty(n, dtype=torch.float32, device=xf.device)
    uniform_into(u, 0, key)
    t.add_(u).floor_().clamp_(-levels, levels)  # clamp: fp rounding of x*L/s may exceed L
    del u
    torch.nan_to_num(t, nan=0.0, out=t)  # after the clamp no inf is left: only NaN changes
    return t.to(wire_dtype), t, step


def decode_reference(summed, chunk, step, dtype):
    """Step 3 in torch ops (the oracle of ``shared_scale_decode``): ``(float(sum) * step).to(dtype)``."""
    out = summed.reshape(-1).to(torch.float32)
    return _per_chunk_(out, step, chunk, "mul_").to(dtype)


def _inv_step(scales, levels):
    """fp32 ``(L / s or 0, s / L)`` per chunk: the quantize multiplier and the decode step."""
    inv = torch.where(scales > 0, levels / scales, torch.zeros_like(scales))
    return inv, scales / levels


def part_bounds(n: int, chunk: int, wire_dtype: torch.dtype) -> list[tuple[int, int]]:
    """The ``[a, b)`` element ranges of the pipelined integer round: one per
    :data:`PART_BYTES` of wire integers, whole chunks each. A function of values equal on
    every rank (the bucket's numel, the chunk, the wire dtype): gloo pairs the parts'
    allreduces by issue order.

    Example::

        >>> part_bounds(10_000_000, 2048, torch.int8)[:2]
        [(0, 4194304), (4194304, 8388608)]
    """
    per = max(chunk, PART_BYTES // wire_dtype.itemsize // chunk * chunk)
    return [(a, min(n, a + per)) for a in range(0, n, per)] or [(0, 0)]


def _quantize_part(ck, xf, lo, hi, chunk, inv, step, levels, key, wire_dtype, q, own):
    """``cp_ss_quantize`` of elements ``[lo, hi)`` of the bucket into ``q`` and ``own``."""
    if hi > lo:
        ck.cp_ss_quantize(xf[lo:].data_ptr(), hi - lo, lo, chunk, inv.data_ptr(), step.data_ptr(),
                          float(levels), key & 0xFFFFFFFF, wire_dtype.itemsize * 8,
                          q[lo:].data_ptr(), own[lo:].data_ptr(), cpu_kernels.threads())


def quantize_cpu(xf, chunk, scales, levels, wire_dtype, key, lo=0, hi=None, out=None):
    """Step 2 in one pass of ``csrc/cpu/codec.cpp`` (``cp_ss_quantize``): ``(q, own, step)``
    with the bits of :func:`quantize_reference` (``own`` fp32 = its ``t * step``); ``None``
    where the compiled codec is off or unavailable, or ``xf`` is not a contiguous fp32 CPU
    tensor. ``q`` and ``own`` come from the algorithms' buffer pool, or are ``out`` (a
    ``(q, own)`` pair of bucket-sized buffers). Only elements ``[lo, hi)`` are written (the
    whole bucket by default); they get the bits a whole-bucket call gives them."""
    ck = cpu_kernels.lib(xf)
    if ck is None or xf.dtype != torch.float32 or not xf.is_contiguous():
        return None
    n = xf.numel()
    inv, step = _inv_step(scales, levels)  # as the reference
    if out is None:
        out = (buffers.empty(n, wire_dtype, xf.device), buffers.empty(n, torch.float32, xf.device))
    q, own = out
    _quantize_part(ck, xf, lo, n if hi is None else hi, chunk, inv, step, levels, key, wire_dtype, q, own)
    return q, own, step


def decode_cpu(summed, chunk, step, dtype, base=0, out=None):
    """Step 3 in one pass (``cp_ss_decode``), the bits of :func:`decode_reference`; ``None``
    where the compiled codec is not used. ``summed`` may be the part of the bucket that starts
    at element ``base``: its decode then goes to ``out[base:]`` (fp32) and ``out`` is returned."""
    ck = cpu_kernels.lib(summed)
    if ck is None or summed.dtype not in (torch.int8, torch.int32) or not summed.is_contiguous():
        return None
    n = summed.numel()
    whole = out is None
    if whole:
        out = buffers.empty(n, torch.float32, summed.device)
    if n:
        ck.cp_ss_decode(summed.data_ptr(), summed.dtype.itemsize * 8, n, base, chunk,
                        step.data_ptr(), out[base:].data_ptr(), cpu_kernels.threads())
    return out if (dtype == torch.float32 or not whole) else out.to(dtype)


def _pipelined_cpu(comm, xf, chunk, scales, levels, wire_dtype, key, dtype):
    """Steps 2-3 with the compiled codec, the integer round cut at :func:`part_bounds`: part
    ``k + 1`` is quantized while part ``k`` is on the wire, and each part is decoded when its
    sum arrives (on the collective's callback thread), so the codec hides behind the transfer.
    The bits of one whole-bucket quantize, allreduce and decode (the kernels index the hash
    and the chunk scales by bucket element; integer sums are exact). ``None`` where the
    compiled codec is not used."""
    ck = cpu_kernels.lib(xf)
    if ck is None or xf.dtype != torch.float32 or not xf.is_contiguous():
        return None
    n = xf.numel()
    inv, step = _inv_step(scales, levels)
    q, own = buffers.empty(n, wire_dtype, xf.device), buffers.empty(n, torch.float32, xf.device)
    dec = buffers.empty(n, torch.float32, xf.device)
    futs = []
    for a, b in part_bounds(n, chunk, wire_dtype):
        _quantize_part(ck, xf, a, b, chunk, inv, step, levels, key, wire_dtype, q, own)

        def decode_part(f, a=a):
            summed = f.value()  # gloo: q[a:b] summed in place; other communicators: a new tensor
            if decode_cpu(summed.contiguous(), chunk, step, torch.float32, a, dec) is None:
                raise RuntimeError("shared_scale: the compiled decode is unavailable mid-round")

        futs.append(comm.all_reduce(q[a:b]).then(decode_part))
    own_out = own if dtype == torch.float32 else own.to(dtype)

    def finish(f):
        f.value()  # re-raises the first failed part's error
        return (dec if dtype == torch.float32 else dec.to(dtype)), own_out

    return when_all(futs, None).then(finish)


def _shared_scale(comm, compressor, x, ctx, store):
    """Shared-scale integer allreduce of flat ``x``; see the module docstring."""
    if not compressor.supports("shared_scale"):
        raise TypeError(f"shared_scale needs a compressor of the 'shared_scale' family (bits, "
                        f"chunk, chunk_absmax: QSGD); got {compressor.spec()!r}")
    world, n, chunk = comm.world_size, x.numel(), compressor.chunk
    check_same_layout(comm, "shared_scale", ctx)
    levels, wire_dtype = shared_scale_levels(compressor.bits, world)
    store["shared_scale_levels"] = torch.tensor([levels, wire_dtype.itemsize * 8], dtype=torch.int64)

    xf = x if x.dtype == torch.float32 else x.float()
    local = compressor.chunk_absmax(xf)
    nch = local.numel()
    scales = round_wait(comm, comm.all_gather(local), ctx, "shared_scale scale allgather round").view(world, nch).amax(0)  # intermediate round

    key = stream_key(ctx.seed, ctx.step, ctx.bucket ^ _STREAM_SALT, ctx.rank)
    # CUDA: one kernel scales, dithers, rounds and casts (same bits as the torch path below)
    fast = (cuda_dispatch.shared_scale_quantize(xf, chunk, scales, levels, wire_dtype, key, ctx.dtype)
            if x.is_cuda else None)
    if fast is None and not x.is_cuda:  # CPU: the compiled kernels, pipelined, same bits
        pipelined = _pipelined_cpu(comm, xf, chunk, scales, levels, wire_dtype, key, ctx.dtype)
        if pipelined is not None:
            return pipelined
    if fast is not None:
        q, own, step = fast
        fut = comm.all_reduce(q)
    else:
        q, t, step = quantize_reference(xf, chunk, scales, levels, wire_dtype, key)
        fut = comm.all_reduce(q)
        # while the sum is in flight: this rank's decoded contribution (for error feedback)
        own = _per_chunk_(t, step, chunk, "mul_").to(ctx.dtype)

    def done(f):
        dec = None
        if f.value().is_cuda:
            dec = cuda_dispatch.shared_scale_decode(f.value(), chunk, step, ctx.dtype)
        if dec is not None:
            return dec, own
        return decode_reference(f.value(), chunk, step, ctx.dtype), own

    return fut.then(done)


def shared_scale_error_bound(compressor, xs, dtype=None) -> torch.Tensor:
    """Per-element bound on ``|shared_scale sum - sum(xs)|`` (fp64): each rank errs by less
    than one step ``s / L`` of the shared scale, plus fp slack for the decode."""
    world, n = len(xs), xs[0].numel()
    levels, _ = shared_scale_levels(compressor.bits, world)
    s = torch.stack([compressor.chunk_absmax(x.float()) for x in xs]).amax(0).double()
    per = s.repeat_interleave(compressor.chunk)[:n] / levels
    eps = torch.finfo(dtype or xs[0].dtype).eps
    return world * per * (1 + 4 * levels * 2.0 ** -23) + 4 * eps * sum(x.double().abs() for x in xs)


class SharedScale(Algorithm):
    """Shared per-chunk scales, then one exact integer allreduce (see the module docstring)."""

    name = "shared_scale"
    family = "shared_scale"

    def __call__(self, comm, compressor, x, ctx, store, want: Want = PLAIN):
        return _shared_scale(comm, compressor, x, ctx, store)

    def wire_bytes(self, compressor, numel, dtype=torch.float32, world=2):
        _, wire_dtype = shared_scale_levels(compressor.bits, world)
        nch = -(-numel // compressor.chunk)
        return (world - 1) * (HEADER_BYTES + 4 * nch) + 2 * (world - 1) * numel * wire_dtype.itemsize // world

    def wire_ops(self, model, compressor, numel, dtype, tier="flat"):
        _, wdt = shared_scale_levels(compressor.bits, model.tiers[tier].world)
        nch = -(-numel // compressor.chunk)  # the per-chunk scales go first (fp32 allgather)
        return [(tier, "allgather", str(torch.float32), 4 * nch),
                (tier, "allreduce", str(wdt), numel * wdt.itemsize)]

    def cost(self, model, compressor, numel, dtype, tier="flat"):
        # a tiny allgather of per-chunk scales, then one integer (int8/int32) allreduce
        cc, t = model.compute_for(compressor), model.tiers[tier]
        n = t.world
        if n <= 1:
            return cc.compress(numel) + cc.decompress(numel)
        _, wire_dtype = shared_scale_levels(compressor.bits, n)
        nch = -(-numel // compressor.chunk)
        return (cc.compress(numel) + t.allgather(4 * nch, torch.float32)
                + t.allreduce(numel * wire_dtype.itemsize, wire_dtype) + cc.decompress(numel))

    error_bound = staticmethod(shared_scale_error_bound)


shared_scale = SharedScale()
