"""The sequence-parallel (Ulysses) process groups: building them, and the one process-wide record of them.

Owns: `SequenceGroups` (the sp group, the data-parallel group across sp groups, and the group ZeRO reduces
and shards over, dp x sp, with this process's ranks in each), `build_sequence_groups`, the
process-wide record (`initialize_sequence_parallel`, `record_from_topology`, `current_sequence_groups`,
`destroy_sequence_parallel`; and `record_sp_gradient_mean`, the last engine's way of combining the sp
ranks' gradients, which `sequence/loss.py` reads), and `build_topology`, which gives `initialize()` the run's `Topology` in
agreement with the record. Must not: know about attention, models or data loaders.

Layout: the single source of truth is the mesh's rank arithmetic (comm/topology.py's Note on rank
order: tp innermost, then sp, then dp). Without tensor parallelism that arithmetic gives DeepSpeed's
layout (`parallel_state_sp`): the sp groups are runs of consecutive global ranks, `[i*sp, (i+1)*sp)`;
the data-parallel groups hold the ranks with the same sp rank, one from each sp group (stride sp); the
sequence-data-parallel group (dp x sp) is the whole world. Those groups can be built before any
`Topology` exists (`register_with_transformers` does), and the topology then takes them through an
`mpu`. With tensor parallelism (tp > 1) the sp groups are strided by tp ({0,2},{1,3} at tp=2, sp=2)
and the record is built FROM the run's `Topology` (`record_from_topology`: its group objects, not
copies), so the mesh's groups and the record cannot disagree; a record built earlier over the same
ranks (an earlier engine, or `register_with_transformers` on a model split already) is kept, one with
another layout is refused.

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

from lightspeed.comm.topology import MeshShape, Topology

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
    sp_ranks: tuple[int, ...] = (0,)  # the global ranks of this process's sp group, ascending


def check_sequence_parallel_size(sp_size: int, world_size: int) -> None:
    """A clear error naming the config key when `sp_size` cannot split `world_size` ranks."""
    if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"{KEY} must be a positive integer (got {sp_size!r})")
    if world_size % sp_size != 0:
        raise ValueError(f"{KEY}={sp_size} does not divide the world size {world_size}: the ranks form groups "
                         f"of {sp_size} consecutive ranks, so the world size must be a multiple of it")


def build_sequence_groups(sp_size: int) -> SequenceGroups:
    """Build the groups (tp = 1) over the initialized default group (every rank must call this, in the
    same order). The ranks of each group come from the mesh's arithmetic (see Layout)."""
    if not dist.is_initialized():
        if sp_size == 1:
            return SequenceGroups(1, None, 0, 1, None, 0, 1, None, 0)
        raise RuntimeError(f"{KEY}={sp_size} needs torch.distributed to be initialized (one process per rank); "
                           "call lightspeed.init_distributed() or deepspeed.init_distributed() first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    check_sequence_parallel_size(sp_size, world_size)
    shape = MeshShape.for_world(world_size, sp=sp_size)
    dp_size = world_size // sp_size
    sp_group = dp_group = None
    # new_group is collective over the default group: every rank creates every group, in one order
    for ranks in shape.all_groups("sp"):
        group = dist.new_group(ranks) if sp_size < world_size else None
        if rank in ranks:
            sp_group = group
    for ranks in shape.all_groups("dp"):
        group = dist.new_group(ranks) if dp_size < world_size else None
        if rank in ranks:
            dp_group = group
    # a rank's connection into a group it alone holds still goes through the store rank 0 serves: no rank
    # moves on (and might exit) until every rank has its groups
    dist.barrier()
    return SequenceGroups(sp_world_size=sp_size, sp_group=sp_group, sp_rank=shape.rank("sp", rank),
                          dp_world_size=dp_size, dp_group=dp_group, dp_rank=shape.rank("dp", rank),
                          seq_dp_world_size=world_size, seq_dp_group=None, seq_dp_rank=rank,
                          sp_ranks=tuple(shape.group_ranks("sp", rank)))


def sequence_groups_from_topology(topology: Topology) -> SequenceGroups:
    """The record's view of `topology`: its sp group, its dp group (same tp and sp coordinates) and its
    dp x sp group (the gradient-reduce group), the topology's own group objects."""
    return SequenceGroups(
        sp_world_size=topology.size("sp"), sp_group=topology.group("sp"), sp_rank=topology.rank("sp"),
        dp_world_size=topology.size("dp"), dp_group=topology.group("dp"), dp_rank=topology.rank("dp"),
        seq_dp_world_size=topology.size("dp_sp"), seq_dp_group=topology.grad_reduce_group,
        seq_dp_rank=topology.rank("dp_sp"), sp_ranks=tuple(topology.shape.group_ranks("sp", topology.world_rank)))


def as_group(group: Any) -> Any:
    """A group object for callers outside lightspeed: the world group where ours is None (the default)."""
    return dist.group.WORLD if group is None and dist.is_initialized() else group


_CURRENT: SequenceGroups | None = None


def initialize_sequence_parallel(sp_size: int, tp_size: int = 1) -> SequenceGroups:
    """Build and record this process's groups for `sp_size` (the record, if one of that size and layout
    exists). With `tp_size` > 1 the groups are those of the mesh `Topology.build(tp=tp_size, sp=sp_size)`."""
    if _CURRENT is not None:
        if _CURRENT.sp_world_size != sp_size:
            raise ValueError(f"{KEY}={sp_size}: the sequence-parallel groups of this process were already built "
                             f"with size {_CURRENT.sp_world_size}")
        if tp_size > 1 and dist.is_initialized():
            world_size, rank = dist.get_world_size(), dist.get_rank()
            _check_layout(MeshShape.for_world(world_size, tp=tp_size, sp=sp_size).group_ranks("sp", rank), tp_size)
        return _CURRENT
    if tp_size > 1:
        return record_from_topology(Topology.build(tp=tp_size, sp=sp_size))
    return _record(build_sequence_groups(sp_size))


def record_from_topology(topology: Topology) -> SequenceGroups:
    """Record `topology`'s sp groups as this process's (see Layout); a record that exists already must
    have the same sp ranks (it is kept: same ranks, so the same collectives)."""
    if _CURRENT is not None:
        if _CURRENT.sp_world_size != topology.size("sp"):
            raise ValueError(f"{KEY}={topology.size('sp')}: the sequence-parallel groups of this process were "
                             f"already built with size {_CURRENT.sp_world_size}")
        _check_layout(topology.shape.group_ranks("sp", topology.world_rank), topology.size("tp"))
        return _CURRENT
    return _record(sequence_groups_from_topology(topology))


def _check_layout(mesh_ranks: list[int], tp_size: int) -> None:
    if list(_CURRENT.sp_ranks) != list(mesh_ranks):
        raise ValueError(f"{KEY}={_CURRENT.sp_world_size} with tensor_parallel.autotp_size={tp_size}: this rank's "
                         f"sequence-parallel group must be the mesh's, ranks {list(mesh_ranks)}, but this process "
                         f"built it earlier as ranks {list(_CURRENT.sp_ranks)} (register_with_transformers or "
                         "initialize_sequence_parallel on a model not yet split for tensor parallelism); split the "
                         "model first (tp_model_init) or let initialize() build the groups")


def _record(groups: SequenceGroups) -> SequenceGroups:
    global _CURRENT
    _CURRENT = groups
    return _CURRENT


def current_sequence_groups() -> SequenceGroups | None:
    """The recorded groups, or None when sequence parallelism was never set up in this process."""
    return _CURRENT


def destroy_sequence_parallel() -> None:
    """Forget the record (the groups themselves go with the process group)."""
    global _CURRENT, _SP_GRADIENT_MEAN
    _CURRENT = None
    _SP_GRADIENT_MEAN = None


# whether the last engine initialized with sp > 1 averages gradients over the sp ranks (True: ZeRO-3) or
# sums them (False: ZeRO 0-2, and gradient_allreduce_op "sum"); None: no such engine in this process
_SP_GRADIENT_MEAN: bool | None = None


def record_sp_gradient_mean(averaged: bool) -> None:
    """Recorded by `initialize()` of an engine with sp > 1 (zero/reduce.py's Note on sequence parallelism):
    whether its gradient reduction averages over the sp ranks. The last engine initialized wins."""
    global _SP_GRADIENT_MEAN
    _SP_GRADIENT_MEAN = bool(averaged)


def sp_gradient_mean() -> bool:
    """What `record_sp_gradient_mean` recorded; an error when no engine with sp > 1 was initialized."""
    if _SP_GRADIENT_MEAN is None:
        raise RuntimeError("no engine with sequence_parallel_size > 1 was initialized in this process: how the "
                           "sp ranks' gradients are combined (summed at ZeRO 0-2, averaged at ZeRO 3) is the "
                           "engine's, so call lightspeed.initialize() before computing the sequence-parallel loss")
    return _SP_GRADIENT_MEAN


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


def sequence_parallel_mpu(mpu: Any, sp_size: int) -> Any:
    """The `mpu` the topology is built from (tp = 1), given the caller's `mpu` and the config's `sp_size`
    (1 when unset): the caller's when it has sp groups (its size must agree with a configured one); else,
    when sp groups are recorded or configured, a `SequenceParallelMPU` over the record (built here if
    needed); else the caller's (a Megatron-style mpu, or None)."""
    if hasattr(mpu, "get_sequence_parallel_world_size"):
        given = int(mpu.get_sequence_parallel_world_size())
        if sp_size > 1 and sp_size != given:
            raise ValueError(f"{KEY}={sp_size} in the config, but the mpu passed to initialize() has "
                             f"sequence-parallel groups of {given}")
        return mpu
    recorded = _recorded_size(sp_size)
    if recorded == 1 and sp_size == 1:
        return mpu
    if mpu is not None:
        raise NotImplementedError(f"{KEY}: sequence parallelism with a Megatron-style mpu that has no sequence-"
                                  "parallel groups (get_sequence_parallel_world_size) is not implemented")
    # a recorded group here also covers a config that does not name sequence_parallel_size: ZeRO must
    # still reduce over dp x sp, or the sp ranks' partial gradients would never be summed
    return SequenceParallelMPU(_CURRENT if _CURRENT is not None else initialize_sequence_parallel(sp_size))


def _recorded_size(sp_size: int) -> int:
    """The sp size of the record (1 when none), checked against a configured `sp_size` > 1."""
    if _CURRENT is None:
        return 1
    if sp_size > 1 and _CURRENT.sp_world_size != sp_size:
        raise ValueError(f"{KEY}={sp_size} in the config, but this process built sequence-parallel groups of "
                         f"{_CURRENT.sp_world_size}")
    return _CURRENT.sp_world_size


def build_topology(mpu: Any, sp_size: int = 1, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1) -> Topology:
    """The run's `Topology` for the configured sizes (1 when unset) and the caller's `mpu`, with this
    process's sequence-parallel record consistent with it (see Layout). A pipeline (pp > 1) builds its
    mesh itself, with no mpu. With tp = 1 and ep = 1 the topology takes
    the record's groups through an mpu (`sequence_parallel_mpu`); with tp > 1 or ep > 1 it is built from
    the mesh and the record from it (the record's sp ranks must be the mesh's). Our own
    `SequenceParallelMPU` (register_with_transformers' return) carries nothing the record does not, so
    there it stands for the record. `ep_size` (the model's MoE layers') splits the data-parallel shard
    dim; with a Megatron-style mpu's groups it splits the mpu's data-parallel groups as DeepSpeed does
    (at sp = 1)."""
    if pp_size > 1:
        if mpu is not None and not isinstance(mpu, SequenceParallelMPU):
            raise ValueError("initialize(mpu=...) with a PipelineModule: the pipeline builds its own groups "
                             "(the mesh's pp, dp and tp dims); pass no mpu")
        sp = max(sp_size, _recorded_size(sp_size))
        topology = Topology.build(tp=tp_size, sp=sp, pp=pp_size, ep=ep_size)
        if sp > 1:
            record_from_topology(topology)
        return topology
    if tp_size == 1 and ep_size == 1:
        return Topology.build(mpu=sequence_parallel_mpu(mpu, sp_size), tp=tp_size, sp=sp_size, ep=ep_size)
    if isinstance(mpu, SequenceParallelMPU):
        if sp_size > 1 and mpu.get_sequence_parallel_world_size() != sp_size:
            raise ValueError(f"{KEY}={sp_size} in the config, but the mpu passed to initialize() has "
                             f"sequence-parallel groups of {mpu.get_sequence_parallel_world_size()}")
        mpu = None
    sp = max(sp_size, _recorded_size(sp_size))
    if mpu is not None:  # a Megatron-style mpu: its groups, as at tp = 1
        return Topology.build(mpu=sequence_parallel_mpu(mpu, sp_size), tp=tp_size, sp=sp, ep=ep_size)
    topology = Topology.build(tp=tp_size, sp=sp, ep=ep_size)
    if sp > 1:
        record_from_topology(topology)
    return topology
