"""``FP16``: cast to IEEE half precision on the wire."""

from __future__ import annotations

import logging

import torch

from .cast import Cast
from .registry import register

__all__ = ["FP16"]

logger = logging.getLogger(__name__)


@register("fp16", "half")
class FP16(Cast):
    """fp16 on the wire (2 bytes per element); values beyond ±65504 overflow to inf."""

    name = "fp16"

    wire_dtype = torch.float16
