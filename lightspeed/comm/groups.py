"""ParallelGroups: the process groups a run uses, built once and passed around (no module-level groups)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroups:
    """Data-parallel group and this process's ranks. `dp_group` None means the default (world) group."""

    dp_group: Any
    dp_rank: int
    dp_world_size: int
    world_rank: int
    world_size: int
    local_rank: int

    @classmethod
    def build(cls, mpu=None) -> "ParallelGroups":
        """From an initialized torch.distributed (or a single process when it is not), honouring a
        Megatron-style `mpu` (get_data_parallel_group / _rank / _world_size) as DeepSpeed does."""
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if not dist.is_initialized():
            return cls(None, 0, 1, 0, 1, local_rank)
        world_rank, world_size = dist.get_rank(), dist.get_world_size()
        if mpu is not None:
            return cls(mpu.get_data_parallel_group(), mpu.get_data_parallel_rank(),
                       mpu.get_data_parallel_world_size(), world_rank, world_size, local_rank)
        return cls(None, world_rank, world_size, world_rank, world_size, local_rank)
