"""What the launcher's environment says about this process: rank, world size, local rank.

The one place that reads launcher variables; :mod:`comms.cluster.topology`, :mod:`comms.cluster.mpi` and
every bench ask it instead of reading ``os.environ`` themselves.

Contract of :func:`launch_info`:

* Launchers are tried in this order; the first one whose **rank and world-size variables
  are both set** wins (torchrun sets ``RANK`` inside an MPI or Slurm allocation too, and it
  is the launcher that actually started the process there):

  ============  ======================  ========================  ============================  ==========================
  launcher      rank                    world size                local rank                    local size
  ============  ======================  ========================  ============================  ==========================
  ``torchrun``  ``RANK``                ``WORLD_SIZE``            ``LOCAL_RANK``                ``LOCAL_WORLD_SIZE``
  ``openmpi``   ``OMPI_COMM_WORLD_RANK`` ``OMPI_COMM_WORLD_SIZE`` ``OMPI_COMM_WORLD_LOCAL_RANK`` ``OMPI_COMM_WORLD_LOCAL_SIZE``
  ``mpich``     ``PMI_RANK``            ``PMI_SIZE``              ``MPI_LOCALRANKID``           ``MPI_LOCALNRANKS``
  ``pmix``      ``PMIX_RANK``           ``PMIX_SIZE``             ``PMIX_LOCAL_RANK``           ``PMIX_LOCAL_SIZE``
  ``slurm``     ``SLURM_PROCID``        ``SLURM_NTASKS``          ``SLURM_LOCALID``             from ``SLURM_TASKS_PER_NODE``
  ============  ======================  ========================  ============================  ==========================

  (``mpich`` covers MPICH/Hydra and Intel MPI; Slurm's world size falls back to
  ``SLURM_NPROCS`` and its local size to ``SLURM_NTASKS_PER_NODE``.)
* A variable read while trying a launcher that is set but not an integer raises
  ``ValueError`` naming it (a typo in a job script must not silently make the process a
  rank of nothing); launchers after the one that wins are not read.
* The local rank and size are what the launcher says, or ``None``; they are never derived
  as ``rank % local_size``, which is wrong under round-robin placement (Open MPI's
  ``--map-by node`` puts ranks 0, 2 on node A and 1, 3 on node B).
* Nothing here communicates, except :func:`mpi_launch_info`, which asks an mpi4py
  communicator (collective) when no variable is set.

Example::

    >>> launch_info({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
    ...              "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    LaunchInfo(launcher='openmpi', rank=2, world_size=4, local_rank=1, local_size=2, node_index=None)
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["LaunchInfo", "launch_info", "mpi_launch_info", "mpi_launched", "parse_slurm_tasks_per_node",
           "LAUNCHERS", "MPI_LAUNCHERS"]

logger = logging.getLogger(__name__)

# launchers whose ranks can agree on a rendezvous port through MPI (mpi4py's bcast)
MPI_LAUNCHERS = frozenset({"openmpi", "mpich", "pmix"})

# set by mpirun/mpiexec (Open MPI, MPICH/Hydra, PMI, PMIx, Slurm's PMI) even before MPI_Init;
# HYDRA_CONTROL_FD is there when a Hydra mpiexec started a process without PMI_RANK
_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS",
                "HYDRA_CONTROL_FD")


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher says about this process (``None``: the launcher did not say)."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None
    local_size: int | None
    node_index: int | None = None


def _int(env: Mapping[str, str], key: str) -> int | None:
    v = env.get(key)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {key}={v!r} is not an integer") from None


def parse_slurm_tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's compressed ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"`` -> ``[2, 2, 2, 1]``)."""
    out: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot parse SLURM_TASKS_PER_NODE={spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _plain(name: str, rank: str, world: str, local_rank: str, local_size: str, node: str | None = None):
    """A parser for a launcher that names all four facts in variables of its own."""

    def parse(env: Mapping[str, str]) -> LaunchInfo | None:
        r, w = _int(env, rank), _int(env, world)
        if r is None or w is None:
            return None
        return LaunchInfo(name, r, w, _int(env, local_rank), _int(env, local_size),
                          _int(env, node) if node else None)

    return parse


def _slurm(env: Mapping[str, str]) -> LaunchInfo | None:
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS")
    if rank is None or world is None:
        return None
    node = _int(env, "SLURM_NODEID")
    local_size = None
    tpn = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_STEP_TASKS_PER_NODE")
    if tpn and node is not None:
        counts = parse_slurm_tasks_per_node(tpn)
        if node < len(counts):
            local_size = counts[node]
    if local_size is None:
        local_size = _int(env, "SLURM_NTASKS_PER_NODE")
    return LaunchInfo("slurm", rank, world, _int(env, "SLURM_LOCALID"), local_size, node)


# checked in this order (see the module docstring)
LAUNCHERS: dict[str, Callable[[Mapping[str, str]], LaunchInfo | None]] = {
    "torchrun": _plain("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
    "openmpi": _plain("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                      "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK"),
    "mpich": _plain("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "pmix": _plain("pmix", "PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    "slurm": _slurm,
}


def launch_info(env: Mapping[str, str] | None = None, *, mpi_comm=None) -> LaunchInfo | None:
    """Rank, world, local rank and local size from the launcher's environment.

    Args:
        env: the environment to read (default ``os.environ``); tests pass fakes.
        mpi_comm: an mpi4py communicator to ask when no launcher variable is set.

    Returns:
        A :class:`LaunchInfo`, or ``None`` when nothing identifies the process.

    Raises:
        ValueError: a launcher variable is set but is not an integer.
    """
    env = os.environ if env is None else env
    for parse in LAUNCHERS.values():
        info = parse(env)
        if info is not None:
            return info
    if mpi_comm is not None:
        return mpi_launch_info(mpi_comm)
    return None


def mpi_launch_info(mpi_comm) -> LaunchInfo:
    """Local rank and size from ``mpi_comm.Split_type(COMM_TYPE_SHARED)`` (collective)."""
    from mpi4py import MPI  # lazily: MPI is optional

    shared = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        return LaunchInfo("mpi4py", mpi_comm.Get_rank(), mpi_comm.Get_size(), shared.Get_rank(),
                          shared.Get_size())
    finally:
        shared.Free()


def mpi_launched(env: Mapping[str, str] | None = None) -> bool:
    """True when mpirun/mpiexec started this process (Open MPI, MPICH/Hydra, PMI, PMIx, Slurm PMI).

    Wider than ``launch_info(env).launcher in MPI_LAUNCHERS``: it also answers for an mpiexec
    that exported only part of its variables (a Hydra ``HYDRA_CONTROL_FD``, a lone ``PMI_SIZE``).
    """
    env = os.environ if env is None else env
    return any(k in env for k in _MPI_MARKERS)
