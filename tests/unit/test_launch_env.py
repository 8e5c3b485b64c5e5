"""Launcher environment parsing (comms.cluster.launch_env): no process group, fake environments."""

import pytest

from comms.cluster.launch_env import (LAUNCHERS, MPI_LAUNCHERS, LaunchInfo, launch_info, mpi_launched, parse_slurm_tasks_per_node)


def test_torchrun():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    assert launch_info(env) == LaunchInfo("torchrun", 5, 8, 1, 4, 1)


def test_openmpi_round_robin_local_ranks():
    # --map-by node: ranks 0,2 on node A and 1,3 on node B; rank 2 is local 1 of A
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    info = launch_info(env)
    assert info == LaunchInfo("openmpi", 2, 4, 1, 2, None)
    assert info.local_rank != info.rank % info.local_size  # why rank % local_size is banned


def test_mpich_and_intel_mpi():
    env = {"PMI_RANK": "3", "PMI_SIZE": "6", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "3"}
    assert launch_info(env) == LaunchInfo("mpich", 3, 6, 0, 3, None)


def test_slurm_with_compressed_tasks_per_node():
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
           "SLURM_TASKS_PER_NODE": "2(x3),1"}
    assert launch_info(env) == LaunchInfo("slurm", 6, 7, 0, 1, 3)
    env2 = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2"}
    assert launch_info(env2) == LaunchInfo("slurm", 1, 4, 1, 2, None)
    assert parse_slurm_tasks_per_node("4,2(x2),1") == [4, 2, 2, 1]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        parse_slurm_tasks_per_node("2(3)")


def test_precedence_and_absence():
    both = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert launch_info(both).launcher == "torchrun"
    assert launch_info({}) is None
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK"):
        launch_info({"OMPI_COMM_WORLD_RANK": "x"})


def test_world_size_is_required():
    # a stray RANK (some schedulers export it for other purposes) is not a torchrun launch
    assert launch_info({"RANK": "3"}) is None
    assert launch_info({"RANK": "0", "WORLD_SIZE": "2"}) == LaunchInfo("torchrun", 0, 2, None, None, None)
    assert launch_info({"SLURM_PROCID": "1", "SLURM_NPROCS": "2"}).world_size == 2


def test_pmix_and_precedence_order():
    env = {"PMIX_RANK": "1", "PMIX_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert launch_info(env).launcher == "pmix"
    assert list(LAUNCHERS) == ["torchrun", "openmpi", "mpich", "pmix", "slurm"]
    assert MPI_LAUNCHERS <= set(LAUNCHERS)


def test_local_rank_is_never_derived():
    # the launcher did not say: None, not rank % something
    info = launch_info({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"})
    assert info.local_rank is None and info.local_size is None


def test_mpi_launched():
    assert not mpi_launched({})
    assert not mpi_launched({"RANK": "0", "WORLD_SIZE": "2"})
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK", "HYDRA_CONTROL_FD"):
        assert mpi_launched({key: "1"})
