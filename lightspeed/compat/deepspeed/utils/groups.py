"""`deepspeed.utils.groups`: DeepSpeed's process-group registry, over the records lightspeed keeps: the
sequence-parallel groups of `lightspeed.comm.sequence_groups` (transformers' sequence-parallel loss calls
`_get_sequence_parallel_group()`), and the topology the last `initialize()` built
(`lightspeed.comm.topology.current_topology`): its data-parallel, tensor-parallel and expert groups.
Without either, as DeepSpeed without an mpu, data parallelism is the whole world and the model-parallel
size is 1. An expert group is named as DeepSpeed names them, `ep_size_<N>`, and answers when N is the
run's expert-parallel size."""

import re

from lightspeed.comm import api
from lightspeed.comm.sequence_groups import as_group, current_sequence_groups
from lightspeed.comm.topology import Topology, current_topology, record_topology


def _get_sequence_parallel_group():
    """The sp group, or None without sequence parallelism (DeepSpeed's answer)."""
    groups = current_sequence_groups()
    return None if groups is None else as_group(groups.sp_group)


def _get_sequence_parallel_world_size() -> int:
    groups = current_sequence_groups()
    return 1 if groups is None else groups.sp_world_size


def _get_sequence_parallel_rank() -> int:
    groups = current_sequence_groups()
    return 0 if groups is None else groups.sp_rank


def _get_data_parallel_group():
    """Data parallelism across sp groups, or the recorded topology's; the world group without either."""
    groups, topology = current_sequence_groups(), current_topology()
    if groups is not None:
        return as_group(groups.dp_group)
    return as_group(None if topology is None else topology.group("dp"))


def _get_data_parallel_world_size() -> int:
    groups, topology = current_sequence_groups(), current_topology()
    if groups is not None:
        return groups.dp_world_size
    return api.get_world_size() if topology is None else topology.size("dp")


def _get_data_parallel_rank() -> int:
    groups, topology = current_sequence_groups(), current_topology()
    if groups is not None:
        return groups.dp_rank
    return api.get_rank() if topology is None else topology.rank("dp")


def _get_sequence_data_parallel_group():
    """dp x sp: the group ZeRO reduces over (the data-parallel group without sequence parallelism)."""
    groups = current_sequence_groups()
    return as_group(None if groups is None else groups.seq_dp_group)


def _get_sequence_data_parallel_world_size() -> int:
    groups = current_sequence_groups()
    return api.get_world_size() if groups is None else groups.seq_dp_world_size


def _get_sequence_data_parallel_rank() -> int:
    groups = current_sequence_groups()
    return api.get_rank() if groups is None else groups.seq_dp_rank


def get_tensor_model_parallel_group():
    """The tensor-parallel group of the recorded topology (None before any `initialize()`)."""
    topology = current_topology()
    return None if topology is None else as_group(topology.group("tp"))


def get_tensor_model_parallel_world_size() -> int:
    topology = current_topology()
    return 1 if topology is None else topology.size("tp")


def get_tensor_model_parallel_rank() -> int:
    topology = current_topology()
    return 0 if topology is None else topology.rank("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of tensor-parallel rank 0 of this rank's group (tp is innermost)."""
    size = get_tensor_model_parallel_world_size()
    return (api.get_rank() // size) * size


get_model_parallel_group = _get_model_parallel_group = _get_tensor_model_parallel_group = \
    get_tensor_model_parallel_group
get_model_parallel_world_size = _get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


def _expert_topology(group_name: str):
    """The recorded topology, checked to have the expert-parallel size `group_name` ("ep_size_<N>") names."""
    match = re.fullmatch(r"ep_size_(\d+)", str(group_name))
    if match is None:
        raise ValueError(f"deepspeed.utils.groups: expert group names are 'ep_size_<N>' (got {group_name!r})")
    topology = current_topology()
    size = 1 if topology is None else topology.size("ep")
    if int(match.group(1)) != size:
        raise ValueError(f"deepspeed.utils.groups: no expert group {group_name}: the run's expert-parallel size is "
                         f"{size}")
    return topology


def _get_expert_parallel_group(group_name: str):
    """The ranks holding different experts (DeepSpeed's expert-parallel group of `group_name`)."""
    topology = _expert_topology(group_name)
    return as_group(None if topology is None else topology.group("ep"))


def _get_expert_data_parallel_group(group_name: str):
    """The ranks holding the same experts (DeepSpeed's expert-data-parallel group of `group_name`)."""
    topology = _expert_topology(group_name)
    return as_group(None if topology is None else topology.group("edp"))


def _get_expert_parallel_world_size(group_name: str) -> int:
    topology = _expert_topology(group_name)
    return 1 if topology is None else topology.size("ep")


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    topology = _expert_topology(group_name)
    return api.get_world_size() if topology is None else topology.size("edp")


def _get_expert_parallel_rank(group_name: str) -> int:
    topology = _expert_topology(group_name)
    return 0 if topology is None else topology.rank("ep")


def _get_expert_data_parallel_rank(group_name: str) -> int:
    topology = _expert_topology(group_name)
    return api.get_rank() if topology is None else topology.rank("edp")


def _expert_group_dict(get) -> dict:
    """{"ep_size_<N>": get("ep_size_<N>")} for the run's expert-parallel size N."""
    topology = current_topology()
    name = f"ep_size_{1 if topology is None else topology.size('ep')}"
    return {name: get(name)}


def _get_expert_parallel_group_dict() -> dict:
    return _expert_group_dict(_get_expert_parallel_group)


def _get_expert_data_parallel_group_dict() -> dict:
    return _expert_group_dict(_get_expert_data_parallel_group)


def _create_expert_and_data_parallel(expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False) -> None:
    """DeepSpeed's set-up of the expert-parallel and expert-data-parallel groups of size
    `expert_parallel_size_`, before `initialize()` (which builds them itself from the model's MoE layers):
    records a topology with that expert-parallel size over the world. Nothing to do when the recorded
    topology already has it; a recorded one with another size is a ValueError."""
    if use_data_before_expert_parallel_:
        raise NotImplementedError("use_data_before_expert_parallel_: expert groups laid out data-parallel first are "
                                  "not implemented in lightspeed")
    topology = current_topology()
    if topology is not None:
        if topology.size("ep") != int(expert_parallel_size_):
            raise ValueError(f"deepspeed.utils.groups: the run's expert-parallel size is {topology.size('ep')}, "
                             f"not {expert_parallel_size_}")
        return
    record_topology(Topology.build(ep=int(expert_parallel_size_)))


def _get_max_expert_size() -> int:
    topology = current_topology()
    return 1 if topology is None else topology.size("ep")


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group():
    return _get_expert_parallel_group(_get_max_expert_size_name())


class DeprecatedException(Exception):
    """DeepSpeed's error for a groups API it has retired."""


def initialize(ep_size: int = 1, mpu=None):
    """Retired in DeepSpeed: raises DeprecatedException (the expert-parallel size is given to
    `deepspeed.moe.layer.MoE(..., ep_size=...)`)."""
    raise DeprecatedException("deepspeed.utils.groups.initialize() is deprecated: pass ep_size to "
                              "deepspeed.moe.layer.MoE(..., ep_size=...) instead")
