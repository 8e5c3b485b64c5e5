"""What compress and decompress of one bucket agree on (:class:`Context`), and the argument
checks every compressor shares: a clear error naming the bad value, raised before any work."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

__all__ = ["Context", "check_input", "check_density", "check_chunk", "ALIGNS", "check_align"]


@dataclass(frozen=True)
class Context:
    """What compress and decompress of one bucket agree on.

    Args:
        numel: elements of the flat input.
        dtype: dtype of the input and of the decoded output.
        device: where the tensors live.
        step: training iteration (mixes into the hash RNG).
        bucket: bucket index (mixes into the hash RNG).
        rank: this rank; only private randomness may depend on it.
        seed: the seed every rank shares.
        shapes: shapes of the tensors that make up the flat input, in order (a DDP bucket's
            parameters); ``()`` means unknown: the input is one flat vector. Compressors that
            use it (PowerSGD per layer) go through :meth:`known_shapes`, which drops shapes
            that do not add up to ``numel`` (e.g. a shard of a hierarchical algorithm).
    """

    numel: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step: int = 0
    bucket: int = 0
    rank: int = 0
    seed: int = 0
    shapes: tuple = ()

    @classmethod
    def of(cls, x: torch.Tensor, **kw) -> "Context":
        return cls(numel=x.numel(), dtype=x.dtype, device=x.device, **kw)

    def with_(self, **kw) -> "Context":
        return replace(self, **kw)

    def known_shapes(self) -> tuple:
        """``shapes`` as a tuple of int tuples when they tile exactly ``numel`` elements, else ``()``."""
        if not self.shapes:
            return ()
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        return shapes if sum(math.prod(s) for s in shapes) == self.numel else ()


def check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"gradients must be floating point, got dtype {x.dtype}")


def check_density(density) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise TypeError(f"density must be a number, got {density!r}")
    if not (0.0 < float(density) <= 1.0):
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def check_chunk(chunk) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        raise TypeError(f"chunk must be an int, got {chunk!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk!r}")
    return chunk


ALIGNS = ("tensor", "flat")


def check_align(align) -> str:
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align!r}")
    return align
