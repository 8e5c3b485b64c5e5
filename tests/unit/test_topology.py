"""Node grouping (no communication); launcher variables are tests/unit/test_launch_env.py."""

import pytest

from comms.cluster.topology import Topology, _decode_names, _encode_name


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
