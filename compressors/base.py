"""The ``Compressor`` interface: tensor -> payload (what goes on the wire) -> tensor.

Compressors are pure: no process groups, no communication, no DDP. They declare which
aggregation families (DESIGN.md §3) can move their payloads:

* ``"allreduce"``  payload tensors can be summed elementwise (linear family);
* ``"allgather"``  payloads are rank specific: gather all, decode each, sum in rank order;
* ``"two_phase"``  compress chunks, all-to-all, decode-sum, re-compress, allgather;
* ``"shared_scale"`` quantize with a scale shared by all ranks, integer-sum allreduce.

Everything a receiver needs to decode another rank's payload is in the payload itself or
in the :class:`Context`, which all ranks share for a bucket (numel, dtype, step, bucket,
seed) — except ``rank``, which only private randomness (stochastic rounding) may use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import ClassVar, Sequence

import torch

__all__ = ["Context", "Compressor", "FAMILIES", "check_density", "check_chunk", "check_input"]

logger = logging.getLogger(__name__)

FAMILIES = ("allreduce", "allgather", "two_phase", "shared_scale")


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
    """

    numel: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    step: int = 0
    bucket: int = 0
    rank: int = 0
    seed: int = 0

    @classmethod
    def of(cls, x: torch.Tensor, **kw) -> "Context":
        return cls(numel=x.numel(), dtype=x.dtype, device=x.device, **kw)

    def with_(self, **kw) -> "Context":
        return replace(self, **kw)


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


class Compressor:
    """Base class. Subclasses set ``name``/``families`` and implement the three methods.

    Attributes:
        name: registry name (``compressors.get(name)``).
        families: aggregation families that can move this compressor's payloads.
        lossless: decompress(compress(x)) == x exactly.
        fixed_size: payload shapes depend only on ``ctx.numel`` (no size exchange needed).
        unbiased: E[decompress(compress(x))] == x over the hash-RNG streams.
    """

    name: ClassVar[str] = "base"
    families: ClassVar[tuple[str, ...]] = ()
    lossless: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    unbiased: ClassVar[bool] = False

    # -- the interface ---------------------------------------------------------------
    def compress(self, x: torch.Tensor, ctx: Context) -> list[torch.Tensor]:
        """Encode flat ``x`` into the tensors that go on the wire."""
        raise NotImplementedError

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Context) -> torch.Tensor:
        """Decode a payload (own or another rank's) into a flat tensor of ``ctx.dtype``."""
        raise NotImplementedError

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes this compressor puts on the wire for an input of ``numel`` elements."""
        raise NotImplementedError

    # -- helpers with sensible defaults -------------------------------------------------
    def decompress_add_(self, payload: Sequence[torch.Tensor], ctx: Context,
                        acc: torch.Tensor) -> torch.Tensor:
        """``acc += decompress(payload)``; sparse compressors override to skip the dense temp."""
        return acc.add_(self.decompress(payload, ctx))

    def config(self) -> dict:
        """Constructor arguments, for specs, state dicts and the cross-rank config check."""
        return {}

    def spec(self) -> str:
        cfg = self.config()
        if not cfg:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_fmt(v)}" for k, v in cfg.items())

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound on ``|decompress(compress(x)) - x|`` for one round trip."""
        return x.abs()

    def supports(self, family: str) -> bool:
        return family in self.families

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.config().items()))))


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v) if isinstance(v, float) else str(v)
