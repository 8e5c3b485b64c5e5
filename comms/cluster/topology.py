"""Topology discovery: which ranks share a node, and the intra-/inter-node groups.

What the launcher says (rank, local rank and size) comes from :mod:`comms.cluster.launch_env` and is
only cross-checked here: node *identity*, which is what the groups
are built from, comes from hostnames allgathered over the process group (bytes in a uint8
tensor), or from an explicit override: the ``node=`` argument or ``COMMPRESS_NODE``
(clusters whose hostnames are unreliable, containers, tests faking several nodes on one
machine).

Groups: one intra-node group per node (its ranks in global-rank order) and one inter-node
group per local index ``i`` (the ``i``-th rank of every node that has one). The local index
is the position of a rank among its node's ranks *ordered by global rank* — never
``rank % local_size``, which is wrong under Open MPI's round-robin placement (ranks 0, 2 on
node A and 1, 3 on node B).

Example::

    >>> topo = Topology.discover()               # collective: every rank calls it
    >>> topo.nodes, topo.local_rank, topo.local_size
    ([[0, 1], [2, 3]], 1, 2)
    >>> topo.intra.all_reduce(t).wait()          # the node's ranks
    >>> topo.inter.all_reduce(t).wait()          # one rank per node, same local index
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from ..transport.communicator import Communicator, TorchCommunicator
from ..transport.waits import wait
from .launch_env import LaunchInfo, launch_info

__all__ = ["Topology", "TieredCommunicator", "tiered_communicator", "NODE_ENV", "NAME_BYTES"]

logger = logging.getLogger(__name__)

NODE_ENV = "COMMPRESS_NODE"
NAME_BYTES = 256  # fixed width of an allgathered node name


def _encode_name(name: str) -> torch.Tensor:
    raw = name.encode("utf-8")
    if not raw or len(raw) > NAME_BYTES:
        raise ValueError(f"node name must be 1..{NAME_BYTES} bytes of UTF-8, got {name!r}")
    buf = torch.zeros(NAME_BYTES, dtype=torch.uint8)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _decode_names(table: torch.Tensor) -> list[str]:
    out = []
    for row in table.view(-1, NAME_BYTES).cpu().tolist():
        n = row.index(0) if 0 in row else NAME_BYTES
        out.append(bytes(row[:n]).decode("utf-8"))
    return out



# Every sub-group this module created, alive until the process exits. Suspected cause of a rare
# abort ("std::system_error: Resource deadlock avoided", 4-rank hierarchical test): a gloo
# group's last reference dropped on one of its own worker threads (a completion callback, or
# the garbage collector run there), whose destructor then joins that thread. Unconfirmed;
# c10d's own registry holds the groups as long anyway, until destroy_process_group().
_GROUPS: list = []

class TieredCommunicator(Communicator):
    """A flat communicator plus the intra-node and inter-node communicators of a topology.

    Flat collectives are delegated to ``flat``, so every flat algorithm runs unchanged on it;
    the hierarchical algorithms also use ``intra`` and ``inter``.
    """

    def __init__(self, flat: Communicator, intra: Communicator, inter: Communicator, topology=None):
        self.flat, self.intra, self.inter, self.topology = flat, intra, inter, topology
        self.timeout = getattr(flat, "timeout", None)
        self.rank, self.world_size, self.backend = flat.rank, flat.world_size, flat.backend

    def all_reduce(self, t):
        return self.flat.all_reduce(t)

    def all_gather(self, t):
        return self.flat.all_gather(t)

    def all_to_all(self, t):
        return self.flat.all_to_all(t)

    def reduce_scatter(self, t):
        return self.flat.reduce_scatter(t)

    def broadcast(self, t, src=0):
        return self.flat.broadcast(t, src)


class Topology:
    """Which group rank lives on which node, and the groups that follow from it.

    Build it with :meth:`discover` (collective over the process group) or, without any
    communication, :meth:`from_node_names` (tests, planning offline).

    Attributes:
        rank: this process's rank in the group.
        world_size: ranks in the group.
        node_names: the node name of every group rank, in rank order.
        nodes: the group ranks of each node, nodes ordered by their lowest rank, ranks in
            each node ascending.
        node_index: index of this rank's node in ``nodes``.
        local_rank: this rank's position in its node (by global rank).
        local_size: ranks on this rank's node.
        intra / inter: :class:`~comms.transport.communicator.TorchCommunicator` of the intra-node and
            inter-node groups (``None`` until :meth:`build_groups`).

    Example::

        >>> t = Topology.from_node_names(["a", "b", "a", "b"], rank=2)
        >>> t.nodes, t.local_rank, t.inter_ranks
        ([[0, 2], [1, 3]], 1, [2, 3])
    """

    def __init__(self, node_names: Sequence[str], rank: int, launch: LaunchInfo | None = None):
        names = list(node_names)
        if not (0 <= rank < len(names)):
            raise ValueError(f"rank {rank} is outside a world of {len(names)} node names")
        self.rank, self.world_size, self.node_names, self.launch = rank, len(names), names, launch
        first: dict[str, int] = {}
        for r, n in enumerate(names):
            first.setdefault(n, r)
        order = sorted(first, key=first.get)
        self.nodes = [[r for r, n in enumerate(names) if n == name] for name in order]
        self.node_index = order.index(names[rank])
        self.local_rank = self.nodes[self.node_index].index(rank)
        self.local_size = len(self.nodes[self.node_index])
        self.intra: Communicator | None = None
        self.inter: Communicator | None = None
        self.process_group = None
        if launch is not None and launch.local_size is not None and launch.local_size != self.local_size:
            logger.info("launcher says local_size=%s but %d ranks share node %r; using the node names",
                           launch.local_size, self.local_size, names[rank])

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_node_names(cls, node_names: Sequence[str], rank: int) -> "Topology":
        return cls(node_names, rank)

    @classmethod
    def discover(cls, process_group=None, node: str | None = None, *, build_groups: bool = True,
                 env: Mapping[str, str] | None = None) -> "Topology":
        """Allgather every rank's node name over ``process_group`` and build the groups.

        Collective: every rank of the group must call it, in the same order as other
        collectives. Nothing but this allgather (and ``new_group``) communicates.

        Args:
            process_group: the group (``None``: WORLD). Its backend must support allgather of
                uint8 (gloo does; for NCCL the names travel in a CUDA tensor).
            node: this rank's node name; default ``$COMMPRESS_NODE``, else the hostname.
            build_groups: also create the intra- and inter-node process groups.
            env: environment to read (tests).

        Raises:
            ValueError: an empty or over-long node name (before any communication).
        """
        env = os.environ if env is None else env
        name = node if node is not None else (env.get(NODE_ENV) or socket.gethostname())
        if not isinstance(name, str):
            raise TypeError(f"node must be a str, got {type(name).__name__}")
        mine = _encode_name(name)
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        if str(dist.get_backend(process_group)) == "nccl":
            mine = mine.cuda()
        tc = TorchCommunicator(process_group)
        table = wait(tc.all_gather(mine), tc.timeout, f"commpress: node-name allgather on rank {rank} of {world}")
        if table.numel() != world * NAME_BYTES:
            raise RuntimeError(f"node-name allgather returned {table.numel()} bytes, expected {world * NAME_BYTES}")
        topo = cls(_decode_names(table), rank, launch_info(env))
        topo.process_group = process_group
        if build_groups:
            topo.build_groups(process_group)
        logger.info("topology: %d node(s) %s; rank %d is local %d/%d", len(topo.nodes), topo.nodes,
                    rank, topo.local_rank, topo.local_size)
        return topo

    def build_groups(self, process_group=None) -> None:
        """Create one intra-node group per node and one inter-node group per local index.

        Collective over ``process_group``: every rank creates every group, in the same order
        (``new_group`` requires it), and keeps the two it belongs to.
        """
        def to_global(ranks):
            if process_group is None:
                return list(ranks)
            return [dist.get_global_rank(process_group, r) for r in ranks]

        for node in self.nodes:
            g = dist.new_group(to_global(node))
            _GROUPS.append(g)
            if self.rank in node:
                self.intra = TorchCommunicator(g)
        for i in range(max(len(n) for n in self.nodes)):
            members = self.inter_ranks_for(i)
            g = dist.new_group(to_global(members))
            _GROUPS.append(g)
            if self.rank in members:
                self.inter = TorchCommunicator(g)

    # -- derived facts ----------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def uniform(self) -> bool:
        """Every node has the same number of ranks (the hierarchical algorithm needs it)."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def intra_ranks(self) -> list[int]:
        return list(self.nodes[self.node_index])

    def inter_ranks_for(self, local_index: int) -> list[int]:
        return [n[local_index] for n in self.nodes if len(n) > local_index]

    @property
    def inter_ranks(self) -> list[int]:
        return self.inter_ranks_for(self.local_rank)

    @property
    def hierarchical(self) -> bool:
        """Worth a hierarchy: several nodes, several ranks per node, equal sizes."""
        return self.num_nodes > 1 and self.local_size > 1 and self.uniform

    def communicator(self, flat: Communicator | None = None) -> TieredCommunicator:
        """A :class:`TieredCommunicator` over the groups (call :meth:`build_groups` first)."""
        if self.intra is None or self.inter is None:
            raise RuntimeError("Topology.communicator() needs build_groups() first")
        return TieredCommunicator(flat or TorchCommunicator(self.process_group), self.intra,
                                  self.inter, self)

    def __repr__(self) -> str:
        return (f"Topology(rank={self.rank}, world={self.world_size}, nodes={self.nodes}, "
                f"local={self.local_rank}/{self.local_size})")

    def __getstate__(self):
        # process groups do not pickle
        return {k: v for k, v in self.__dict__.items() if k not in ("intra", "inter", "process_group")} | {
            "intra": None, "inter": None, "process_group": None}


def tiered_communicator(comm: Communicator, process_group=None, node: str | None = None,
                        topology: "Topology | None" = None) -> "tuple[Communicator, Topology | None]":
    """The communicator the algorithms should use, and the topology behind it (collective).

    With several nodes of several ranks each: discover the topology (unless given; node names
    from ``node``, ``$COMMPRESS_NODE`` or hostnames), build its intra- and inter-node groups
    and return a :class:`TieredCommunicator` over ``comm``; otherwise ``comm`` itself.
    A given ``topology`` must have its groups built.
    """
    if comm.world_size <= 1 or getattr(comm, "intra", None) is not None:
        return comm, topology
    if topology is None and isinstance(comm, TorchCommunicator):
        group = comm.group if process_group is None else process_group
        topology = Topology.discover(group, node, build_groups=False)
        if topology.hierarchical:
            topology.build_groups(group)
    if topology is not None and topology.hierarchical:
        if topology.intra is None:
            raise ValueError("a given topology needs Topology.build_groups() first")
        return topology.communicator(comm), topology
    return comm, topology
