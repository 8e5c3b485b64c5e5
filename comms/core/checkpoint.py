"""Checkpoint and config-check helpers shared by every hook state (DDP, FSDP, HSDP).

``plain`` turns what a state keeps into what ``torch.load(weights_only=True)`` reads back;
``to_device`` restores it; ``hash64`` is the process-independent hash the cross-rank
configuration check compares. ``owner`` stamps a state dict with the rank that saved it and
``check_owner`` refuses it on another rank (residuals, velocities and stores are per rank:
rank 0's file on every rank trains on the wrong error feedback). ``settle`` / ``settled``
record that a state's resume was dealt with (loaded, or its absence reported), for the
first-step check of :func:`comms.register.pair_optimizer`.
"""

from __future__ import annotations

import hashlib
import weakref

import torch
import torch.distributed as dist

__all__ = ["hash64", "plain", "to_device", "owner", "check_owner", "settle", "settled"]

_SETTLED: "weakref.WeakSet" = weakref.WeakSet()


def owner() -> dict[str, int]:
    """``{"rank": r, "world": w}`` of this process in the default group (0 and 1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return {"rank": dist.get_rank(), "world": dist.get_world_size()}
    return {"rank": 0, "world": 1}


def check_owner(sd: dict) -> None:
    """Raise ``ValueError`` when ``sd`` was saved by another rank or world size (a state dict
    without the stamp, from an older checkpoint, passes)."""
    if not isinstance(sd, dict) or sd.get("rank") is None:
        return
    mine, saved = owner(), (int(sd["rank"]), int(sd.get("world", 0)))
    if saved != (mine["rank"], mine["world"]):
        raise ValueError(f"this commpress state was saved by rank {saved[0]} of {saved[1]}; this process "
                         f"is rank {mine['rank']} of {mine['world']}. Residuals, velocities and "
                         "algorithm stores are per rank: load each rank's own file (e.g. "
                         f"commpress.rank{mine['rank']}.pt); with another world size start "
                         "without it (the residuals restart from zero)")


def settle(state) -> None:
    """Record that ``state``'s resume was dealt with: loaded, or its absence reported."""
    _SETTLED.add(state)


def settled(state) -> bool:
    return state in _SETTLED


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
