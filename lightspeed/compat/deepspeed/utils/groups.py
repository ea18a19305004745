"""`deepspeed.utils.groups`: DeepSpeed's process-group registry. lightspeed keeps no module-level groups
(the engine's `ParallelGroups` is built once and passed around); the sequence-, expert- and
tensor-parallel groups belong to features not built yet and raise NotImplementedError naming them."""

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
_get_model_parallel_group = _missing("_get_model_parallel_group", "tensor parallelism in training")
_get_tensor_model_parallel_group = _missing("_get_tensor_model_parallel_group", "tensor parallelism in training")
