"""`deepspeed.utils.groups`: DeepSpeed's process-group registry. lightspeed keeps no module-level groups
(the engine's `ParallelGroups` is built once and passed around); the sequence-, expert- and
tensor-parallel groups raise NotImplementedError naming what is missing (sequence and expert parallelism
are not built; the tensor-parallel group is the engine's `groups.topology.group("tp")`)."""

from lightspeed.compat.deepspeed._missing import missing_function


def _missing(name: str, feature: str):
    return missing_function(f"deepspeed.utils.groups.{name}", feature)


_SP = "sequence parallelism (Ulysses)"
_get_sequence_parallel_group = _missing("_get_sequence_parallel_group", _SP)
_get_sequence_parallel_world_size = _missing("_get_sequence_parallel_world_size", _SP)
_get_sequence_parallel_rank = _missing("_get_sequence_parallel_rank", _SP)
_get_sequence_data_parallel_group = _missing("_get_sequence_data_parallel_group", _SP)
_get_expert_parallel_group = _missing("_get_expert_parallel_group", "expert parallelism (MoE)")
_get_expert_data_parallel_group = _missing("_get_expert_data_parallel_group", "expert parallelism (MoE)")
_TP = "a module-level tensor-parallel group (tensor parallelism is built; its group lives in the engine's Topology)"
_get_model_parallel_group = _missing("_get_model_parallel_group", _TP)
_get_tensor_model_parallel_group = _missing("_get_tensor_model_parallel_group", _TP)
