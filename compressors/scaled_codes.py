"""The shared decode side of the scaled-codes codecs (QSGD, ScaledSign): payload ``[scales,
packed codes]``, one scale per chunk, with the tensor-aligned chunk layout."""

from __future__ import annotations

import math

import torch

from .base import Compressor
from .context import Context, check_input
from .memory import fresh_empty

__all__ = ["ScaledCodesDecoder"]


class ScaledCodesDecoder(Compressor):
    """Codecs whose payload is ``[scales, packed codes]`` with one scale per chunk (QSGD,
    ScaledSign): each subclass implements ``_compress_flat(x, ctx)`` and
    ``_decode(payload, ctx, out, accumulate)`` for a flat vector, ``code_bits`` and ``chunk``,
    and names its CUDA launchers in ``_cuda_decompress`` / ``_cuda_decompress_add_``
    (``compressors.cuda.dispatch`` functions returning None when they do not apply).

    **Tensor-aligned chunks** (``align="tensor"``): when the context knows the
    bucket's parameter shapes (``ctx.known_shapes()``, two or more tensors), the chunk grid
    restarts at every tensor, so no scale straddles two tensors (a LayerNorm gain does not
    share a scale with the neighbouring weight's entries). Payload: the tensors' flat
    payloads one after another — scales ``sum(ceil(n_i / chunk))``, codes
    ``sum(ceil(n_i * bits / 8))`` bytes. Private randomness (QSGD rounding) uses a stream per
    tensor. Without shapes (two-phase chunks, hierarchical shards, direct calls) the layout
    is the flat one: ``align="flat"`` behaviour.
    """

    _cuda_decompress = None
    _cuda_decompress_add_ = None
    align: str = "flat"
    code_bits: int = 8
    chunk: int = 1

    # -- tensor-aligned layout ----------------------------------------------------------
    def _segments(self, ctx):
        """``[(e0, e1, s0, s1, b0, b1)]`` element, scale and code-byte ranges per tensor, or
        ``None`` for the flat layout."""
        if self.align != "tensor" or len(ctx.shapes) < 2:
            return None
        shapes = ctx.known_shapes()
        if len(shapes) < 2:
            return None
        from .bitpack import packed_nbytes

        segs, e, sc, b = [], 0, 0, 0
        for sh in shapes:
            n = math.prod(sh)
            if n == 0:
                continue
            nc, nb = -(-n // self.chunk), packed_nbytes(n, self.code_bits)
            segs.append((e, e + n, sc, sc + nc, b, b + nb))
            e, sc, b = e + n, sc + nc, b + nb
        return segs if len(segs) > 1 else None

    def shaped_wire_bytes(self, shapes, dtype=torch.float32) -> int:
        """Bytes of one payload for a bucket of tensors of ``shapes`` (its own layout)."""
        segs = self._segments(Context(numel=sum(math.prod(s) for s in shapes), shapes=tuple(shapes)))
        if segs is None:
            return self.wire_bytes(sum(math.prod(s) for s in shapes), dtype)
        return 4 * segs[-1][3] + segs[-1][5]

    def payload_layout(self, ctx) -> tuple:
        """``((scales, float32), (code bytes, uint8))``: the payload :meth:`compress` returns
        for ``ctx`` (its size and, tensor-aligned, its shapes), without compressing."""
        from .bitpack import packed_nbytes

        segs = self._segments(ctx)
        if segs is None:
            return ((-(-ctx.numel // self.chunk), torch.float32),
                    (packed_nbytes(ctx.numel, self.code_bits), torch.uint8))
        return ((segs[-1][3], torch.float32), (segs[-1][5], torch.uint8))

    def _compress_flat(self, x, ctx):
        raise NotImplementedError

    def compress(self, x, ctx):
        segs = self._segments(ctx)
        if segs is None:
            return self._compress_flat(x, ctx)
        check_input(x)
        x = x.detach().reshape(-1)
        s = torch.empty(segs[-1][3], dtype=torch.float32, device=x.device)
        packed = self.payload_pool().empty(segs[-1][5], torch.uint8, x.device)
        for i, (e0, e1, s0, s1, b0, b1) in enumerate(segs):
            # a stream per tensor: rounding noise must not repeat from one tensor to the next
            sub = ctx.with_(numel=e1 - e0, shapes=(), bucket=(ctx.bucket * 0x9E3779B1 + i + 1) & 0xFFFFFFFF)
            ps, pp = self._compress_flat(x[e0:e1], sub)
            s[s0:s1].copy_(ps)
            packed[b0:b1].copy_(pp)
        return [s, packed]

    def _segmented_decode(self, payload, ctx, segs, out, accumulate):
        s, packed = payload
        for e0, e1, s0, s1, b0, b1 in segs:
            pk = packed[b0:b1]
            if pk.is_cuda:
                pk = pk.clone()  # kernels may expect an aligned code buffer
            sub = [s[s0:s1], pk]
            sctx = ctx.with_(numel=e1 - e0, shapes=())
            if accumulate:
                self.decompress_add_(sub, sctx, out[e0:e1])
            else:
                self.decompress_into(sub, sctx, out[e0:e1])
        return out

    def decompress(self, payload, ctx):
        segs = self._segments(ctx)
        if segs is not None:
            out = fresh_empty(ctx.numel, ctx.dtype, payload[1].device)
            return self._segmented_decode(payload, ctx, segs, out, False)
        if payload[1].is_cuda and (out := type(self)._cuda_decompress(self, payload, ctx)) is not None:
            return out
        out = fresh_empty(ctx.numel, ctx.dtype, payload[1].device)
        return self._decode(payload, ctx, out, accumulate=False)

    def decompress_into(self, payload, ctx, out):
        if not out.is_contiguous() or out.numel() != ctx.numel:
            return super().decompress_into(payload, ctx, out)
        segs = self._segments(ctx)
        if segs is not None:
            self._segmented_decode(payload, ctx, segs, out.view(-1), False)
            return out
        if out.is_cuda and payload[1].is_cuda and \
                type(self)._cuda_decompress(self, payload, ctx, out.view(-1)) is not None:
            return out  # the kernels' bits, decoded in place (error feedback's own decode)
        self._decode(payload, ctx, out.view(-1), accumulate=False)
        return out

    def decompress_add_(self, payload, ctx, acc):
        segs = self._segments(ctx)
        if segs is not None and acc.is_contiguous() and acc.numel() == ctx.numel:
            self._segmented_decode(payload, ctx, segs, acc.view(-1), True)
            return acc
        if segs is None and acc.is_cuda and \
                (out := type(self)._cuda_decompress_add_(self, payload, ctx, acc)) is not None:
            return out
        if not acc.is_contiguous() or acc.numel() != ctx.numel:
            return super().decompress_add_(payload, ctx, acc)
        self._decode(payload, ctx, acc.view(-1), accumulate=True)
        return acc
