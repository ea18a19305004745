"""ParallelGroups: the data-parallel view of the run's `Topology` (comm/topology.py) that the engine and
the ZeRO strategies read, built once and passed around (no module-level groups)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightspeed.comm.topology import Topology


@dataclass(frozen=True)
class ParallelGroups:
    """Data-parallel group and this process's ranks, and the `topology` they come from. `dp_group` None
    means the default (world) group."""

    dp_group: Any
    dp_rank: int
    dp_world_size: int
    world_rank: int
    world_size: int
    local_rank: int
    topology: Topology | None = None

    @classmethod
    def from_topology(cls, topology: Topology) -> "ParallelGroups":
        return cls(topology.group("dp"), topology.rank("dp"), topology.size("dp"), topology.world_rank,
                   topology.size("world"), topology.local_rank,
                   topology)

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

