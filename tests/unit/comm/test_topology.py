"""The mesh's rank arithmetic (no processes): coordinates with tp innermost, group membership of every dim
and flattened dim, the norm rule, and the errors for sizes that do not fit the world."""

from __future__ import annotations

import pytest

from lightspeed.comm.topology import MeshShape, Topology, TopologyError


def test_tp_is_innermost_then_sp_then_dp():
    shape = MeshShape.for_world(8, tp=2, sp=2)
    assert shape.dp_shard == 2 and shape.world_size == 8
    assert shape.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.all_groups("sp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.all_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.all_groups("dp_sp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert shape.all_groups("world") == [list(range(8))]
    assert shape.coords(5) == {"tp": 1, "sp": 0, "ep": 0, "edp_shard": 1, "dp_replicate": 0, "pp": 0}
    assert all(shape.rank_of(shape.coords(r)) == r for r in range(8))
    assert (shape.rank("tp", 5), shape.rank("dp", 5), shape.rank("dp_sp", 7)) == (1, 1, 3)
    assert (shape.size("dp"), shape.size("dp_sp"), shape.size("tp_dp_sp")) == (2, 4, 8)


def test_pipeline_stages_are_outermost():
    """DeepSpeed's PipeModelDataParallelTopology: pipe, data, model (model innermost)."""
    shape = MeshShape.for_world(8, tp=2, pp=2)
    assert shape.dp_shard == 2
    assert shape.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.all_groups("tp_dp_sp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one pipeline stage's ranks
    assert shape.coords(6) == {"tp": 0, "sp": 0, "ep": 0, "edp_shard": 1, "dp_replicate": 0, "pp": 1}


def test_expert_groups_split_dp_shard():
    """DeepSpeed's expert groups: ep consecutive data-parallel ranks, expert-data-parallel strided by ep."""
    shape = MeshShape.for_world(8, ep=2)
    assert (shape.dp_shard, shape.edp_shard, shape.ep) == (8, 4, 2)
    assert shape.all_groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.all_groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert shape.all_groups("dp") == [list(range(8))]  # the dense parameters still see every dp rank
    shape = MeshShape.for_world(8, tp=2, sp=2, ep=2)  # tp and sp inside: an ep group strides over them
    assert shape.all_groups("ep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.all_groups("edp_sp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.size("edp") == 1 and shape.size("dp_sp") == 4
    assert shape.all_groups_over(("ep", "tp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_sizes_from_a_config():
    from lightspeed.comm.topology import mesh_sizes

    assert mesh_sizes({"tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 4}) == {"tp": 2, "sp": 4}
    assert mesh_sizes({"tensor_parallel": {"autotp_size": 0}}) == {"tp": 1, "sp": 1}
    with pytest.raises(TopologyError, match="sequence_parallel_size: must be a positive integer"):
        mesh_sizes({"sequence_parallel_size": 0})
    topology = Topology.from_config({"tensor_parallel": {"autotp_size": 1}})
    assert topology.size("world") == 1


def test_dp_replicate_is_outside_dp_shard():
    shape = MeshShape.for_world(8, tp=2, dp_replicate=2)
    assert (shape.dp_replicate, shape.dp_shard) == (2, 2)
    assert shape.all_groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.all_groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.all_groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_tp2_dp2():
    shape = MeshShape.for_world(4, tp=2)
    assert shape.all_groups("tp") == [[0, 1], [2, 3]] and shape.all_groups("dp") == [[0, 2], [1, 3]]


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 3}, "world size 4 does not divide by tp=3"),
    ({"tp": 2, "sp": 4}, "does not divide"),
    ({"tp": 0}, "autotp_size must be a positive integer"),
    ({"pp": 3}, "does not divide by tp=1 x sp=1 x dp_replicate=1 x pp=3"),
    ({"ep": 3}, "ep=3 does not divide the data-parallel size 4"),
    ({"tp": 2, "ep": 4}, "ep=4 does not divide the data-parallel size 2"),
])
def test_bad_sizes(kwargs, message):
    with pytest.raises(TopologyError, match=message):
        MeshShape.for_world(4, **kwargs)


def test_unknown_group_name():
    with pytest.raises(KeyError, match="no mesh group 'pipe'"):
        MeshShape.for_world(2).size("pipe")


def test_single_process_topology():
    topology = Topology.build()
    assert topology.group("dp") is None and topology.group("tp") is None
    assert [topology.size(n) for n in ("dp", "tp", "sp", "dp_sp", "world")] == [1] * 5
    assert topology.rank("tp") == 0 and topology.coords() == dict.fromkeys(topology.coords(), 0)
    with pytest.raises(TopologyError, match="does not divide by tp=2"):
        Topology.build(tp=2)
