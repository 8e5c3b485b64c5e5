"""``ScaledSign``: 1 bit per element (the sign), times the chunk's mean |x| (signSGD/EF-SGD).

Format (shared with csrc/): bit 1 for ``x >= 0``, 0 otherwise; per chunk scale
``s = mean|x|`` over the chunk's real elements; decode ``x' = +s`` or ``-s``.
Payload: ``[scales (nchunks, fp32), bits (ceil(n/8), uint8)]``. Biased: use error feedback.
"""

from __future__ import annotations

import logging

import torch

from .base import Compressor, check_chunk, check_input
from .bitpack import pack, packed_nbytes, unpack
from .registry import register

__all__ = ["ScaledSign"]

logger = logging.getLogger(__name__)


@register("sign", "scaledsign", "signsgd")
class ScaledSign(Compressor):
    """Scaled sign compression.

    Args:
        chunk: elements per scale.
    """

    name = "sign"
    families = ("allgather", "two_phase")

    def __init__(self, chunk: int = 2048):
        self.chunk = check_chunk(chunk)

    def config(self):
        return {"chunk": self.chunk}

    def nchunks(self, numel):
        return -(-numel // self.chunk)

    def wire_bytes(self, numel, dtype=torch.float32):
        return 4 * self.nchunks(numel) + packed_nbytes(numel, 1)

    def _scales(self, xf: torch.Tensor) -> torch.Tensor:
        n = xf.numel()
        c = self.chunk
        nfull = n // c
        nch = self.nchunks(n)
        s = torch.empty(nch, dtype=torch.float32, device=xf.device)
        if nfull:
            torch.mean(xf[: nfull * c].view(nfull, c).abs(), dim=1, out=s[:nfull])
        if nch > nfull:
            s[nfull] = xf[nfull * c:].abs().mean()
        return s

    def compress(self, x, ctx):
        check_input(x)
        xf = x.float()
        s = self._scales(xf)
        bits = (xf >= 0).to(torch.uint8)
        return [s, pack(bits, 1)]

    def decompress(self, payload, ctx):
        s, packed = payload
        n = ctx.numel
        b = unpack(packed, 1, n).float()  # 0/1
        per = s.repeat_interleave(self.chunk)[:n]
        out = b.mul_(2).sub_(1).mul_(per)
        return out.to(ctx.dtype)

    def error_bound(self, x):
        xf = x.float()
        s = self._scales(xf).repeat_interleave(self.chunk)[: x.numel()]
        return (xf.abs() + s).to(x.dtype)
