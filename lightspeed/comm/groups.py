"""ParallelGroups: the data-parallel view of the run's `Topology` (comm/topology.py) that the engine and
the ZeRO strategies read, built once and passed around (no module-level groups)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightspeed.comm.topology import Topology


@dataclass(frozen=True)
class ParallelGroups:
    """This process's groups and ranks, and the `topology` they come from. A group of None means the
    default (world) group.

    `dp_*`: data parallelism, the replicas that see different batches (DeepSpeed's `dp_world_size`; the
    batch triad counts it). `sp_*`: the Ulysses sequence-parallel group (size 1 without it).
    `seq_dp_*`: dp x sp, the group ZeRO reduces gradients and partitions state over (DeepSpeed's
    sequence-data-parallel group, the topology's `grad_reduce_group`); the same as dp without sequence
    parallelism.
    """

    dp_group: Any
    dp_rank: int
    dp_world_size: int
    world_rank: int
    world_size: int
    local_rank: int
    topology: Topology | None = None
    sp_group: Any = None
    sp_rank: int = 0
    sp_world_size: int = 1
    seq_dp_group: Any = None
    seq_dp_rank: int = 0
    seq_dp_world_size: int = 1

    @classmethod
    def from_topology(cls, topology: Topology) -> "ParallelGroups":
        sp = topology.size("sp")
        seq_dp = topology.size("dp_sp")
        return cls(topology.group("dp"), topology.rank("dp"), topology.size("dp"), topology.world_rank,
                   topology.size("world"), topology.local_rank, topology,
                   sp_group=topology.group("sp") if sp > 1 else None, sp_rank=topology.rank("sp") if sp > 1 else 0,
                   sp_world_size=sp, seq_dp_group=topology.grad_reduce_group,
                   seq_dp_rank=topology.rank("dp_sp"), seq_dp_world_size=seq_dp)

    @classmethod
    def build(cls, mpu=None, *, tp: int = 1, sp: int = 1) -> "ParallelGroups":
        """From an initialized torch.distributed (or a single process when it is not), honouring a
        Megatron-style `mpu` (get_data_parallel_group / _rank / _world_size, and its model-parallel
        groups) as DeepSpeed does."""
        return cls.from_topology(Topology.build(tp=tp, sp=sp, mpu=mpu))

    @property
    def tp_world_size(self) -> int:
        return 1 if self.topology is None else self.topology.size("tp")

    @property
    def tp_rank(self) -> int:
        return 0 if self.topology is None else self.topology.rank("tp")
