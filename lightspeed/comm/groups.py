"""ParallelGroups: the process groups a run uses, built once and passed around (no module-level groups)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightspeed.comm.sequence_groups import KEY, current_sequence_groups, initialize_sequence_parallel


@dataclass(frozen=True)
class ParallelGroups:
    """This process's groups and ranks. A group of None means the default (world) group.

    `dp_*`: data parallelism, the replicas that see different batches (DeepSpeed's `dp_world_size`; the
    batch triad counts it). `sp_*`: the Ulysses sequence-parallel group (size 1 without it).
    `seq_dp_*`: dp x sp, the group ZeRO reduces gradients and partitions state over (DeepSpeed's
    sequence-data-parallel group); the same as dp without sequence parallelism.
    """

    dp_group: Any
    dp_rank: int
    dp_world_size: int
    world_rank: int
    world_size: int
    local_rank: int
    sp_group: Any = None
    sp_rank: int = 0
    sp_world_size: int = 1
    seq_dp_group: Any = None
    seq_dp_rank: int = 0
    seq_dp_world_size: int = 1

    @classmethod
    def build(cls, mpu=None, sequence_parallel_size: int | None = None) -> "ParallelGroups":
        """From an initialized torch.distributed (or a single process when it is not), honouring a
        Megatron-style `mpu` (get_data_parallel_group / _rank / _world_size) as DeepSpeed does, an `mpu`
        with sequence parallelism (`register_with_transformers`' one, or DeepSpeed's `parallel_state_sp`
        shape: get_sequence_parallel_world_size), the config's `sequence_parallel_size`, and otherwise the
        sequence-parallel groups this process already built."""
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        sp_size = _sequence_parallel_size(mpu, sequence_parallel_size)
        if not dist.is_initialized():
            if sp_size > 1:
                initialize_sequence_parallel(sp_size)  # raises: sp needs processes
            return cls(None, 0, 1, 0, 1, local_rank, seq_dp_world_size=1)
        world_rank, world_size = dist.get_rank(), dist.get_world_size()
        if sp_size > 1:
            sg = initialize_sequence_parallel(sp_size)
            return cls(sg.dp_group, sg.dp_rank, sg.dp_world_size, world_rank, world_size, local_rank,
                       sg.sp_group, sg.sp_rank, sg.sp_world_size, sg.seq_dp_group, sg.seq_dp_rank,
                       sg.seq_dp_world_size)
        if mpu is not None:
            group, rank, size = (mpu.get_data_parallel_group(), mpu.get_data_parallel_rank(),
                                 mpu.get_data_parallel_world_size())
            return cls(group, rank, size, world_rank, world_size, local_rank,
                       seq_dp_group=group, seq_dp_rank=rank, seq_dp_world_size=size)
        return cls(None, world_rank, world_size, world_rank, world_size, local_rank,
                   seq_dp_group=None, seq_dp_rank=world_rank, seq_dp_world_size=world_size)


def _sequence_parallel_size(mpu, configured: int | None) -> int:
    from_mpu = mpu.get_sequence_parallel_world_size() if hasattr(mpu, "get_sequence_parallel_world_size") else None
    if from_mpu is not None and configured not in (None, from_mpu):
        raise ValueError(f"{KEY}={configured} in the config, but the mpu passed to initialize() has "
                         f"sequence-parallel groups of {from_mpu}")
    if from_mpu is not None and hasattr(mpu, "get_model_parallel_world_size") and mpu.get_model_parallel_world_size() > 1:
        raise NotImplementedError(f"{KEY}: sequence parallelism together with a model-parallel mpu is not implemented")
    if from_mpu is None and configured is None:
        # built earlier in this process (register_with_transformers): ZeRO must still reduce over dp x sp,
        # or the sp ranks' partial gradients would never be summed
        recorded = current_sequence_groups()
        return recorded.sp_world_size if recorded is not None else 1
    return int(from_mpu or configured)
