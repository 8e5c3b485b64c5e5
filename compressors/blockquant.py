"""``BlockQuantizer``: block-wise symmetric int8/int4 codes of a flat float tensor (the
parameter all-gather codec of :mod:`comms.fsdp.params`; ZeRO++'s qwZ format).

Format (one payload per rank, ``n`` elements, ``B`` = :data:`BLOCK` = 256, ``nb = ceil(n / B)``
blocks, the last one zero-padded):

* ``[scales (nb x fp32) | codes]`` as bytes; ``scales[b]`` = max |x| over block ``b``;
* int8: one ``int8`` code per element, ``round(x * 127 / scale)`` in ``[-127, 127]``;
* int4: two codes per byte (element ``2i`` in the low nibble, ``2i + 1`` in the high one),
  each ``round(x * 7 / scale) + 8`` in ``[1, 15]``;
* decode: ``code * (scale / L)`` (``L`` = 127 or 7), in fp32, cast to the output dtype.

Rounding is round-half-to-even and deterministic (no randomness: the forward and the
backward all-gather of a step must see the same parameters). A block of zeros has scale 0 and
decodes to zeros; a non-finite block decodes to NaN. Every rank decodes the same bytes with
the same elementwise ops, so every rank holds the same values — its own shard included.
The payload size is a multiple of 4 bytes, so rows of a gathered buffer stay fp32-aligned.

Example::

    >>> q = BlockQuantizer(8)
    >>> x = torch.linspace(-1, 1, 300)
    >>> out = torch.empty(300)
    >>> q.decode_into(q.encode(x), out, world=1)
    >>> float((out - x).abs().max()) <= 1 / 254
    True
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "PARAM_BITS", "BlockQuantizer"]

#: elements per block (one fp32 scale each: 1.6% of an int8 payload)
BLOCK = 256
#: the supported code widths
PARAM_BITS = (8, 4)


class BlockQuantizer:
    """Encode one rank's flat shard; decode a rank-major gather of such payloads.

    Args:
        bits: 8 or 4.

    Raises:
        ValueError: another width.
    """

    __slots__ = ("bits", "levels")

    def __init__(self, bits: int):
        if bits not in PARAM_BITS:
            raise ValueError(f"block quantization bits must be one of {PARAM_BITS}, got {bits!r}")
        self.bits = bits
        self.levels = 127 if bits == 8 else 7

    def blocks(self, n: int) -> int:
        return -(-n // BLOCK)

    def payload_bytes(self, n: int) -> int:
        """Bytes of one rank's payload for ``n`` elements."""
        nb = self.blocks(n)
        return 4 * nb + nb * BLOCK * self.bits // 8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The uint8 payload of the flat float tensor ``x`` (see the module docstring)."""
        n = x.numel()
        nb = self.blocks(n)
        blocks = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
        blocks[:n] = x.reshape(-1)
        blocks = blocks.view(nb, BLOCK)
        out = torch.empty(self.payload_bytes(n), dtype=torch.uint8, device=x.device)
        scale = out[:4 * nb].view(torch.float32)
        torch.amax(blocks.abs(), dim=1, out=scale)
        inv = torch.where(scale > 0, self.levels / scale, torch.zeros_like(scale))
        codes = blocks.mul_(inv.unsqueeze(1)).round_().clamp_(-self.levels, self.levels)
        codes = codes.nan_to_num_(0.0).to(torch.int8)
        if self.bits == 8:
            out[4 * nb:].view(torch.int8).copy_(codes.view(-1))
        else:
            u = codes.view(-1, 2).add_(8).to(torch.uint8)
            torch.bitwise_or(u[:, 0], u[:, 1].bitwise_left_shift(4), out=out[4 * nb:])
        return out

    def decode_into(self, recv: torch.Tensor, out: torch.Tensor, world: int) -> None:
        """Decode ``world`` payloads laid end to end in ``recv`` (rank order) into ``out``
        (``world x n`` elements, any float dtype): rank ``r``'s values at ``[r n, (r+1) n)``."""
        n = out.numel() // world
        nb, nbytes = self.blocks(n), self.payload_bytes(n)
        if recv.numel() != world * nbytes or out.numel() != world * n:
            raise ValueError(f"block-quantized gather of {recv.numel()} bytes does not hold {world} "
                             f"payloads of {n} elements ({nbytes} bytes each)")
        rows = recv.view(world, nbytes)
        step = (rows[:, :4 * nb].view(torch.float32) / self.levels).unsqueeze(2)  # (world, nb, 1)
        codes = rows[:, 4 * nb:]
        if self.bits == 8:
            vals = codes.view(torch.int8).view(world, nb, BLOCK).to(torch.float32)
        else:
            lo = codes.bitwise_and(15).to(torch.float32).sub_(8)
            hi = codes.bitwise_right_shift(4).to(torch.float32).sub_(8)
            vals = torch.stack((lo, hi), dim=-1).view(world, nb, BLOCK)
        o, full = out.view(world, n), n // BLOCK
        if out.dtype == torch.float32 and full:  # whole blocks straight into the output
            torch.mul(vals[:, :full], step[:, :full], out=o[:, :full * BLOCK].view(world, full, BLOCK))
            if n > full * BLOCK:
                o[:, full * BLOCK:] = vals[:, full, :n - full * BLOCK] * step[:, full]
            return
        o.copy_(vals.mul_(step).view(world, nb * BLOCK)[:, :n])
