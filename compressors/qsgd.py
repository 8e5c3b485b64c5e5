"""``QSGD``: b-bit stochastic quantization with per-chunk max-abs scales, bit-packed.

Format (shared with csrc/quantize.cu; change both or neither). For chunk ``c`` of ``chunk``
elements (the last one may be short) with ``s = max|x|`` over the chunk, ``M = 2**bits - 1``
levels span ``[-s, s]`` uniformly (``bits=1`` is stochastic sign times s):

* encode: ``r = fp32(M/2) / s`` (0 when s == 0), ``t = fl(fl(x*r) + fp32(M/2))``,
  ``q = clamp(floor(fl(t + u)), 0, M)`` with ``u`` from the hash RNG stream
  ``stream_key(seed, step, bucket, rank)`` at the element's index;
* decode: ``w = fl(fl(2*s) / M)``, ``x' = fl(fl(q*w) - s)``.

Unbiased: ``E[q] = t`` because u is uniform, hence ``E[x'] = x``. Error per element < ``w``.
Payload: ``[scales (nchunks, fp32), codes (ceil(n*bits/8), uint8)]``.
"""

from __future__ import annotations

import logging

import torch

from .base import Compressor, check_chunk, check_input
from .bitpack import check_bits, pack, packed_nbytes, unpack
from .hashrng import stream_key, uniform_into
from .registry import register

__all__ = ["QSGD", "chunk_absmax"]

logger = logging.getLogger(__name__)


def chunk_absmax(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """fp32 max|x| per chunk of ``chunk`` elements (last chunk may be short)."""
    n = x.numel()
    nfull = n // chunk
    nch = -(-n // chunk)
    out = torch.empty(nch, dtype=torch.float32, device=x.device)
    if nfull:
        torch.amax(x[: nfull * chunk].view(nfull, chunk).abs(), dim=1, out=out[:nfull])
    if nch > nfull:
        out[nfull] = x[nfull * chunk:].abs().max()
    return out


@register("qsgd")
class QSGD(Compressor):
    """Stochastic b-bit quantization (QSGD-style) with per-chunk scales.

    Args:
        bits: 1, 2, 4 or 8 bits per element on the wire.
        chunk: elements per scale (one fp32 scale per chunk).
    """

    name = "qsgd"
    families = ("allgather", "two_phase", "shared_scale")
    unbiased = True

    def __init__(self, bits: int = 8, chunk: int = 2048):
        self.bits = check_bits(bits)
        self.chunk = check_chunk(chunk)

    def config(self):
        return {"bits": self.bits, "chunk": self.chunk}

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def nchunks(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def wire_bytes(self, numel, dtype=torch.float32):
        return 4 * self.nchunks(numel) + packed_nbytes(numel, self.bits)

    def _per_element(self, per_chunk: torch.Tensor, n: int) -> torch.Tensor:
        return per_chunk.repeat_interleave(self.chunk)[:n]

    def compress(self, x, ctx):
        check_input(x)
        n = x.numel()
        xf = x.float()
        M = self.levels
        half = torch.tensor(M * 0.5, dtype=torch.float32)
        s = chunk_absmax(xf, self.chunk)
        r = torch.where(s > 0, half / s, torch.zeros_like(s))
        t = xf * self._per_element(r, n)
        t.add_(half)
        u = torch.empty(n, dtype=torch.float32, device=x.device)
        uniform_into(u, 0, stream_key(ctx.seed, ctx.step, ctx.bucket, ctx.rank))
        t.add_(u).floor_().clamp_(0, M)
        codes = t.to(torch.uint8)
        return [s, pack(codes, self.bits)]

    def decompress(self, payload, ctx):
        s, packed = payload
        n = ctx.numel
        q = unpack(packed, self.bits, n).float()
        w = (2 * s) / float(self.levels)
        out = q.mul_(self._per_element(w, n)).sub_(self._per_element(s, n))
        return out.to(ctx.dtype)

    def error_bound(self, x):
        s = chunk_absmax(x.float(), self.chunk)
        return self._per_element(2 * s / self.levels, x.numel()).to(x.dtype)
