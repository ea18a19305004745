"""The Topology on real gloo processes: world 4 as tp2 x dp2 (groups reduce over the ranks the mesh says),
the data-parallel-only world keeps the default group, the Megatron-style mpu adapter, and the
ParallelGroups view derived from it."""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _members(topology, name):
    """The global ranks a collective on the group `name` reaches, as this rank sees them."""
    from lightspeed.comm.collectives import Communicator

    comm = Communicator(topology.group(name), topology.size(name))
    if comm.world_size == 1:
        return [topology.world_rank]
    gathered = torch.zeros(comm.world_size)
    comm.all_gather(gathered, torch.tensor([float(topology.world_rank)]))
    return [int(v) for v in gathered]


def _members_over(topology, dims):
    from lightspeed.comm.collectives import Communicator

    comm = Communicator(topology.group_over(dims), topology.size_over(dims))
    gathered = torch.zeros(comm.world_size)
    comm.all_gather(gathered, torch.tensor([float(topology.world_rank)]))
    return [int(v) for v in gathered]


def _mesh_world():
    from lightspeed.comm.groups import ParallelGroups
    from lightspeed.comm.topology import Topology

    topology = Topology.build(tp=2)
    groups = ParallelGroups.from_topology(topology)
    out = {name: (topology.rank(name), _members(topology, name)) for name in ("tp", "dp", "dp_sp", "sp")}
    out["groups"] = (groups.dp_rank, groups.dp_world_size, groups.tp_rank, groups.tp_world_size)
    out["tp_x_dp"] = _members_over(topology, ("tp", "edp_shard", "ep"))
    experts = Topology.build(ep=2)  # dp4 as edp2 x ep2
    out["experts"] = {name: (experts.rank(name), _members(experts, name)) for name in ("ep", "edp", "dp", "edp_sp")}
    stages = Topology.build(tp=2, pp=2)
    out["stages"] = {name: (stages.rank(name), _members(stages, name)) for name in ("pp", "tp", "dp", "tp_dp_sp")}
    return out


def test_tp2_dp2_groups():
    results = run_world(_mesh_world, 4)
    for rank, out in enumerate(results):
        tp_rank, dp_rank = rank % 2, rank // 2
        assert out["tp"] == (tp_rank, [rank - tp_rank, rank - tp_rank + 1])
        assert out["dp"] == (dp_rank, [tp_rank, tp_rank + 2])
        assert out["dp_sp"] == out["dp"]
        assert out["sp"] == (0, [rank])
        assert out["groups"] == (dp_rank, 2, tp_rank, 2)
        assert out["tp_x_dp"] == [0, 1, 2, 3]
        ep0 = rank - rank % 2
        assert out["experts"] == {"ep": (rank % 2, [ep0, ep0 + 1]), "edp": (rank // 2, [rank % 2, rank % 2 + 2]),
                                  "dp": (rank, [0, 1, 2, 3]), "edp_sp": (rank // 2, [rank % 2, rank % 2 + 2])}
        assert out["stages"] == {"pp": (rank // 2, [rank % 2, rank % 2 + 2]), "tp": (rank % 2, [ep0, ep0 + 1]),
                                 "dp": (0, [rank]), "tp_dp_sp": (rank % 2, [ep0, ep0 + 1])}


def _dp_only():
    from lightspeed.comm.topology import Topology

    topology = Topology.build()
    return topology.group("dp") is None, topology.rank("dp"), topology.size("dp"), _members(topology, "tp")


def test_data_parallel_only_uses_the_world_group():
    assert run_world(_dp_only, 2) == [(True, 0, 2, [0]), (True, 1, 2, [1])]


def _mpu_world():
    import torch.distributed as dist

    from lightspeed.comm.groups import ParallelGroups

    rank = dist.get_rank()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]

    class Mpu:  # Megatron's names
        def get_data_parallel_group(self):
            return dp_groups[rank % 2]

        def get_data_parallel_rank(self):
            return rank // 2

        def get_data_parallel_world_size(self):
            return 2

        def get_tensor_model_parallel_group(self):
            return tp_groups[rank // 2]

        def get_tensor_model_parallel_rank(self):
            return rank % 2

        def get_tensor_model_parallel_world_size(self):
            return 2

    groups = ParallelGroups.build(Mpu())
    topology = groups.topology
    from lightspeed.comm.topology import Topology

    experts = Topology.build(mpu=Mpu(), ep=2)  # DeepSpeed's rule: each dp group cut into runs of ep ranks
    expert_groups = {name: (experts.rank(name), experts.size(name), _members(experts, name))
                     for name in ("ep", "edp", "edp_sp", "dp", "tp")}
    expert_groups["edp dims"] = _members_over(experts, ("dp_replicate", "edp_shard"))
    return (groups.dp_rank, groups.dp_world_size, topology.rank("tp"), topology.size("tp"),
            _members(topology, "tp"), _members(topology, "dp"), topology.from_mpu, expert_groups)


def test_megatron_mpu_adapter():
    results = run_world(_mpu_world, 4)
    for rank, out in enumerate(results):
        tp0 = rank - rank % 2
        assert out[:7] == (rank // 2, 2, rank % 2, 2, [tp0, tp0 + 1], [rank % 2, rank % 2 + 2], True)
        dp = [rank % 2, rank % 2 + 2]  # ep 2 takes the whole dp group of 2; each edp group is one rank
        assert out[7] == {"ep": (rank // 2, 2, dp), "edp": (0, 1, [rank]), "edp_sp": (0, 1, [rank]),
                          "dp": (rank // 2, 2, dp), "tp": (rank % 2, 2, [tp0, tp0 + 1]), "edp dims": [rank]}


def _bad_mpu():
    from lightspeed.comm.topology import Topology, TopologyError

    class Mpu:
        def get_data_parallel_world_size(self):
            return 3

    try:
        Topology.build(mpu=Mpu())
    except TopologyError as error:
        return str(error)
    return None


def test_mpu_that_does_not_cover_the_world_errors():
    assert "is not the world size 2" in run_world(_bad_mpu, 2)[0]
