"""``BF16``: cast to bfloat16 on the wire (fp32 range, 8-bit mantissa)."""

from __future__ import annotations

import logging

import torch

from .cast import Cast
from .registry import register

__all__ = ["BF16"]

logger = logging.getLogger(__name__)


@register("bf16", "bfloat16")
class BF16(Cast):
    """bf16 on the wire (2 bytes per element); works on gloo, unlike torch's bf16 hook."""

    name = "bf16"

    wire_dtype = torch.bfloat16
