"""The sequence-parallel (Ulysses) process groups: building them, and the one process-wide record of them.

Owns: `SequenceGroups` (the sp group, the data-parallel group across sp groups, and the group ZeRO reduces
and shards over, dp x sp, with this process's ranks in each), `build_sequence_groups`, and the
process-wide record (`initialize_sequence_parallel`, `current_sequence_groups`,
`destroy_sequence_parallel`). Must not: know about attention, models or data loaders.

Layout (DeepSpeed's, `parallel_state_sp`): the sp groups are runs of consecutive global ranks,
`[i*sp, (i+1)*sp)`; the data-parallel groups hold the ranks with the same sp rank, one from each sp group
(stride sp); the sequence-data-parallel group (dp x sp) is the whole world.

Note: why a process-wide record
    lightspeed otherwise keeps no module-level groups (the engine's `ParallelGroups` is built once and
    passed around). Sequence parallelism cannot work that way: transformers calls
    `deepspeed.utils.groups._get_sequence_parallel_group()` with no arguments from inside its loss
    function, and `UlyssesSPAttentionHF.register_with_transformers` builds the groups before the engine
    exists, returning an `mpu` that `initialize(mpu=...)` receives. So the groups are built once per
    process, recorded here, and everything else (the engine, the compat `groups` functions, the data
    loader adapter) reads that record. Building them again with the same size returns the record;
    a different size is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

KEY = "sequence_parallel_size"


@dataclass(frozen=True)
class SequenceGroups:
    """This process's sequence-parallel groups. A group of None is the default (world) group."""

    sp_world_size: int
    sp_group: Any
    sp_rank: int
    dp_world_size: int       # data parallel across sp groups (ranks with the same sp rank)
    dp_group: Any
    dp_rank: int
    seq_dp_world_size: int   # dp x sp: the group ZeRO reduces gradients and shards state over
    seq_dp_group: Any
    seq_dp_rank: int


def check_sequence_parallel_size(sp_size: int, world_size: int) -> None:
    """A clear error naming the config key when `sp_size` cannot split `world_size` ranks."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"{KEY} must be a positive integer (got {sp_size!r})")
    if world_size % sp_size != 0:
        raise ValueError(f"{KEY}={sp_size} does not divide the world size {world_size}: the ranks form groups "
                         f"of {sp_size} consecutive ranks, so the world size must be a multiple of it")


def build_sequence_groups(sp_size: int) -> SequenceGroups:
    """Build the groups over the initialized default group (every rank must call this, in the same order)."""
    if not dist.is_initialized():
        if sp_size == 1:
            return SequenceGroups(1, None, 0, 1, None, 0, 1, None, 0)
        raise RuntimeError(f"{KEY}={sp_size} needs torch.distributed to be initialized (one process per rank); "
                           "call lightspeed.init_distributed() or deepspeed.init_distributed() first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    check_sequence_parallel_size(sp_size, world_size)
    dp_size = world_size // sp_size
    sp_group = dp_group = None
    # new_group is collective over the default group: every rank creates every group, in one order
    for first in range(0, world_size, sp_size):
        ranks = list(range(first, first + sp_size))
        group = dist.new_group(ranks) if sp_size < world_size else None
        if rank in ranks:
            sp_group = group
    for sp_rank in range(sp_size):
        ranks = list(range(sp_rank, world_size, sp_size))
        group = dist.new_group(ranks) if dp_size < world_size else None
        if rank in ranks:
            dp_group = group
    # a rank's connection into a group it alone holds still goes through the store rank 0 serves: no rank
    # moves on (and might exit) until every rank has its groups
    dist.barrier()
    return SequenceGroups(sp_world_size=sp_size, sp_group=sp_group, sp_rank=rank % sp_size,
                          dp_world_size=dp_size, dp_group=dp_group, dp_rank=rank // sp_size,
                          seq_dp_world_size=world_size, seq_dp_group=None, seq_dp_rank=rank)


def as_group(group: Any) -> Any:
    """A group object for callers outside lightspeed: the world group where ours is None (the default)."""
    return dist.group.WORLD if group is None and dist.is_initialized() else group


_CURRENT: SequenceGroups | None = None


def initialize_sequence_parallel(sp_size: int) -> SequenceGroups:
    """Build and record this process's groups for `sp_size` (the record, if one of that size exists)."""
    global _CURRENT
    if _CURRENT is not None:
        if _CURRENT.sp_world_size != sp_size:
            raise ValueError(f"{KEY}={sp_size}: the sequence-parallel groups of this process were already built "
                             f"with size {_CURRENT.sp_world_size}")
        return _CURRENT
    _CURRENT = build_sequence_groups(sp_size)
    return _CURRENT


def current_sequence_groups() -> SequenceGroups | None:
    """The recorded groups, or None when sequence parallelism was never set up in this process."""
    return _CURRENT


def destroy_sequence_parallel() -> None:
    """Forget the record (the groups themselves go with the process group)."""
    global _CURRENT
    _CURRENT = None


class SequenceParallelMPU:
    """The `mpu` that `register_with_transformers` returns and `initialize(mpu=...)` accepts: DeepSpeed's
    `parallel_state_sp` accessors over one `SequenceGroups`."""

    def __init__(self, groups: SequenceGroups):
        self.groups = groups

    def get_sequence_parallel_group(self):
        return as_group(self.groups.sp_group)

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.sp_world_size

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.sp_rank

    def get_sequence_data_parallel_group(self):
        return as_group(self.groups.seq_dp_group)

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.groups.seq_dp_world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.groups.seq_dp_rank

    def get_data_parallel_group(self):
        return as_group(self.groups.dp_group)

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dp_world_size

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank


def sequence_parallel_mpu(mpu: Any, sp_size: int, tp_size: int = 1) -> Any:
    """The `mpu` the topology is built from, given the caller's `mpu` and the config's `sp_size` (1 when
    unset): the caller's when it has sp groups (its size must agree with a configured one); else, when
    sp groups are recorded or configured, a `SequenceParallelMPU` over the record (built here if needed);
    else the caller's (a Megatron-style mpu, or None)."""
    if hasattr(mpu, "get_sequence_parallel_world_size"):
        given = int(mpu.get_sequence_parallel_world_size())
        if sp_size > 1 and sp_size != given:
            raise ValueError(f"{KEY}={sp_size} in the config, but the mpu passed to initialize() has "
                             f"sequence-parallel groups of {given}")
        return mpu
    recorded = current_sequence_groups()
    if recorded is not None and sp_size > 1 and recorded.sp_world_size != sp_size:
        raise ValueError(f"{KEY}={sp_size} in the config, but this process built sequence-parallel groups of "
                         f"{recorded.sp_world_size}")
    if recorded is None and sp_size == 1:
        return mpu
    if recorded is not None and recorded.sp_world_size == 1:
        return mpu
    if mpu is not None:
        raise NotImplementedError(f"{KEY}: sequence parallelism with a Megatron-style mpu that has no sequence-"
                                  "parallel groups (get_sequence_parallel_world_size) is not implemented")
    if tp_size > 1:
        raise NotImplementedError(f"{KEY}: sequence parallelism together with tensor parallelism "
                                  "(tensor_parallel.autotp_size > 1) is not implemented")
    # a recorded group here also covers a config that does not name sequence_parallel_size: ZeRO must
    # still reduce over dp x sp, or the sp ranks' partial gradients would never be summed
    return SequenceParallelMPU(recorded if recorded is not None else initialize_sequence_parallel(sp_size))
