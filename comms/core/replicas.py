"""``check_replicas``: are the model replicas bitwise equal on every rank?

Each rank hashes every parameter's bit pattern into two int64 numbers (a plain sum and a
position-weighted sum of the raw integers, so a changed bit or two swapped elements both
show), all-gathers the small table and compares. Costs about two reads of the parameters and
two tiny collectives: cheap enough to call every few hundred steps in production.
"""

from __future__ import annotations

import logging

import torch

from ..transport.communicator import Communicator, TorchCommunicator
from ..transport.waits import wait

__all__ = ["check_replicas", "check_tensors", "ReplicaMismatchError", "param_fingerprint", "ReplicaGuard"]

logger = logging.getLogger(__name__)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHT_PERIOD = 65521  # prime: positions weigh 1..65521, so a swap of two elements changes the sum


class ReplicaMismatchError(RuntimeError):
    """Parameters differ between ranks (raised on every rank)."""


def param_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers that change with any bit of ``t`` (sum and weighted sum of its bits)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % _WEIGHT_PERIOD + 1
    # int64 sums wrap around deterministically: equal bits give equal sums on every rank
    return torch.stack([bits.sum(), (bits * weights).sum()])


def _local(t: torch.Tensor, gathered: bool) -> torch.Tensor:
    """A DTensor parameter as what is compared: its local shard, or with ``gathered`` the full
    tensor every rank all-gathers (FSDP: each shard has one holder; the gathered parameters
    are what every rank computes with)."""
    if hasattr(t, "to_local"):
        return t.full_tensor() if gathered else t.to_local()
    return t


def check_replicas(model: torch.nn.Module, process_group=None, *, buffers: bool = False,
                   communicator: Communicator | None = None, gathered: bool = False) -> torch.Tensor:
    """Raise on every rank if any parameter differs between the ranks of the group.

    Args:
        model: the (DDP-wrapped or plain) model; every rank must pass the same architecture.
        process_group: the data-parallel group (``None``: WORLD).
        buffers: also compare buffers (BatchNorm running stats, ...).
        communicator: a :class:`~comms.transport.communicator.Communicator` instead of a group.
        gathered: DTensor parameters (FSDP2) are compared as full tensors (an all-gather of
            each) instead of their local shards (HSDP replicas hold equal shards).

    Returns:
        This rank's ``(num_tensors, 2)`` int64 fingerprint table (equal on all ranks).

    Raises:
        ReplicaMismatchError: naming the first differing parameter and the ranks that differ.
        TypeError: ``model`` is not a ``torch.nn.Module``.

    Example::

        >>> if step % 500 == 0:
        ...     comms.check_replicas(ddp_model)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"check_replicas needs a torch.nn.Module, got {type(model).__name__}")
    module = getattr(model, "module", model)
    named = [(n, _local(p, gathered)) for n, p in module.named_parameters()]
    if buffers:
        named += [(n, _local(b, gathered)) for n, b in module.named_buffers()]
    return check_tensors(named, communicator or TorchCommunicator(process_group))


def check_tensors(named: list, comm: Communicator, label: str = "parameter") -> torch.Tensor:
    """:func:`check_replicas` on ``[(name, tensor)]`` (e.g. the outer sync's synced
    parameters); raises :class:`ReplicaMismatchError` naming the first differing ``label``."""
    device = named[0][1].device if named else torch.device("cpu")
    if device.type != "cpu" and comm.backend in ("gloo", "mpi"):
        device = torch.device("cpu")
    table = torch.stack([param_fingerprint(t).to(device) for _, t in named]) if named \
        else torch.zeros(0, 2, dtype=torch.int64, device=device)
    world = comm.world_size
    what = f"commpress: check_replicas allgather on rank {comm.rank} of {comm.world_size}"
    counts = wait(comm.all_gather(torch.tensor([len(named)], dtype=torch.int64, device=device)), comm.timeout, what)
    counts = counts.cpu().tolist()
    if len(set(counts)) != 1:
        raise ReplicaMismatchError(f"check_replicas: ranks hold different numbers of tensors "
                                   f"{counts}; rank {comm.rank} holds {len(named)}")
    if not named:
        return table
    everyone = wait(comm.all_gather(table.reshape(-1)), comm.timeout, what).view(world, len(named), 2).cpu()
    same = (everyone == everyone[0]).all(dim=2)  # (world, tensors)
    if not bool(same.all()):
        first = int((~same).any(dim=0).nonzero()[0])
        odd = [r for r in range(world) if not bool(same[r, first])]
        name, t = named[first]
        raise ReplicaMismatchError(
            f"check_replicas: {label} {name!r} (shape {tuple(t.shape)}, {t.dtype}) differs "
            f"between ranks: rank(s) {odd} differ from rank 0 (checked on rank {comm.rank}); "
            f"{int((~same).any(dim=0).sum())} of {len(named)} tensors differ")
    return table.cpu()


class ReplicaGuard:
    """The opt-in safety net of ``register(..., check_replicas_every=N)``.

    The hook calls :meth:`maybe_check` with the first bucket of every step; at steps
    ``N, 2N, ...`` (the parameters then hold ``step`` optimizer updates; backward does not
    touch them) it runs :func:`check_replicas`, which raises
    :class:`ReplicaMismatchError` on every rank naming the first differing parameter. Costs
    two tiny collectives and one host sync every ``N`` steps, none otherwise.

    Holds a reference to the module; not pickled with the hook state.
    """

    __slots__ = ("module", "every", "checks", "gathered")

    def __init__(self, module: torch.nn.Module, every: int, gathered: bool = False):
        if isinstance(every, bool) or not isinstance(every, int):
            raise TypeError(f"check_replicas_every must be an int, got {every!r}")
        if every < 1:
            raise ValueError(f"check_replicas_every must be >= 1 (or 0/None: off), got {every!r}")
        self.module, self.every, self.checks, self.gathered = module, every, 0, gathered

    def maybe_check(self, step: int, comm: Communicator) -> None:
        if step > 0 and step % self.every == 0:
            try:
                check_replicas(self.module, communicator=comm, gathered=self.gathered)
            except ReplicaMismatchError as exc:
                raise ReplicaMismatchError(f"commpress: replica check at step {step} "
                                           f"(check_replicas_every={self.every}): {exc}") from None
            self.checks += 1
