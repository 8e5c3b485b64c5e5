"""Checkpoint and config-check helpers shared by every hook state (DDP, FSDP, HSDP).

``plain`` turns what a state keeps into what ``torch.load(weights_only=True)`` reads back;
``to_device`` restores it; ``hash64`` is the process-independent hash the cross-rank
configuration check compares.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["hash64", "plain", "to_device"]


def hash64(value) -> int:
    """A process-independent signed 64-bit hash (Python's ``hash`` of str is salted per process)."""
    h = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


def plain(value, where: str):
    """Deep copy of ``value`` into what ``torch.load(weights_only=True)`` reads back.

    Raises:
        TypeError: ``value`` holds something else than tensors, numbers, str, ``None`` and
            lists/tuples/dicts of those (``where`` names it).
    """
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {k: plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise TypeError(f"{where} holds a {type(value).__name__}, which a weights_only checkpoint "
                    "cannot hold; algorithm stores may keep tensors, numbers, str and containers")


def to_device(value, device):
    """``value`` (from :func:`plain`) with its tensors moved to ``device`` (``None``: copied)."""
    if isinstance(value, torch.Tensor):
        return value.to(device) if device is not None else value.clone()
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value
