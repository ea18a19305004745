"""`deepspeed.utils.groups`: DeepSpeed's process-group registry, over the one record lightspeed keeps
(the sequence-parallel groups of `lightspeed.comm.sequence_groups`; without them, as DeepSpeed without an
mpu, data parallelism is the whole world: under tensor parallelism the engine's
`groups.topology.group("dp")` is the data-parallel group). transformers' sequence-parallel loss calls
`_get_sequence_parallel_group()`. The expert-parallel groups raise NotImplementedError (not built); the
tensor-parallel group is the engine's `groups.topology.group("tp")`."""

from lightspeed.comm import api
from lightspeed.comm.sequence_groups import as_group, current_sequence_groups
from lightspeed.compat.deepspeed._missing import missing_function


def _missing(name: str, feature: str):
    return missing_function(f"deepspeed.utils.groups.{name}", feature)


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
    """Data parallelism across sp groups; the world group without sequence parallelism."""
    groups = current_sequence_groups()
    return as_group(None if groups is None else groups.dp_group)


def _get_data_parallel_world_size() -> int:
    groups = current_sequence_groups()
    return api.get_world_size() if groups is None else groups.dp_world_size


def _get_data_parallel_rank() -> int:
    groups = current_sequence_groups()
    return api.get_rank() if groups is None else groups.dp_rank


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


_get_expert_parallel_group = _missing("_get_expert_parallel_group", "expert parallelism (MoE)")
_get_expert_data_parallel_group = _missing("_get_expert_data_parallel_group", "expert parallelism (MoE)")
_TP = "a module-level tensor-parallel group (tensor parallelism is built; its group lives in the engine's Topology)"
_get_model_parallel_group = _missing("_get_model_parallel_group", _TP)
_get_tensor_model_parallel_group = _missing("_get_tensor_model_parallel_group", _TP)
