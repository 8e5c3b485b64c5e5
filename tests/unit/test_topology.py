"""Launcher environment parsing and node grouping (no communication)."""

import pytest

from comms.topology import (LaunchInfo, Topology, _decode_names, _encode_name, launch_info,
                            parse_slurm_tasks_per_node)


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


def test_nodes_ordered_by_global_rank_round_robin():
    names = ["a", "b", "a", "b", "a", "b"]
    for rank in range(6):
        t = Topology.from_node_names(names, rank)
        assert t.nodes == [[0, 2, 4], [1, 3, 5]]
        assert t.local_size == 3 and t.num_nodes == 2 and t.uniform and t.hierarchical
        assert t.local_rank == rank // 2
        assert t.inter_ranks == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert t.intra_ranks == t.nodes[rank % 2]


def test_uneven_and_single_node():
    t = Topology.from_node_names(["x", "x", "x", "y"], 3)
    assert t.nodes == [[0, 1, 2], [3]] and not t.uniform and not t.hierarchical
    assert t.inter_ranks_for(0) == [0, 3] and t.inter_ranks_for(2) == [2]
    one = Topology.from_node_names(["h"] * 4, 2)
    assert one.num_nodes == 1 and one.local_rank == 2 and not one.hierarchical
    with pytest.raises(ValueError, match="rank 4"):
        Topology.from_node_names(["h"] * 4, 4)


def test_name_encoding_round_trip():
    import torch

    names = ["node-01", "ünï", "x" * 256]
    table = torch.cat([_encode_name(n) for n in names])
    assert _decode_names(table) == names
    with pytest.raises(ValueError, match="node name"):
        _encode_name("")
    with pytest.raises(ValueError, match="node name"):
        _encode_name("y" * 257)
