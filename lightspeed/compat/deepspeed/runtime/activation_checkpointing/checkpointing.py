"""`deepspeed.checkpointing` (DeepSpeed's `runtime.activation_checkpointing.checkpointing`).

Activation checkpointing is a later lightspeed feature. The module imports, so scripts that import it
at the top still start; every function raises NotImplementedError naming the feature, and
`is_configured()` truthfully answers False.
"""

from lightspeed.compat.deepspeed._missing import missing_class, missing_function

_FEATURE = "activation checkpointing (deepspeed.checkpointing)"


def _missing(name: str):
    return missing_function(f"deepspeed.checkpointing.{name}", _FEATURE)


configure = _missing("configure")
checkpoint = _missing("checkpoint")
non_reentrant_checkpoint = _missing("non_reentrant_checkpoint")
reset = _missing("reset")
get_cuda_rng_tracker = _missing("get_cuda_rng_tracker")
model_parallel_cuda_manual_seed = _missing("model_parallel_cuda_manual_seed")
partition_activations_in_checkpoint = _missing("partition_activations_in_checkpoint")
set_num_layers = _missing("set_num_layers")
CheckpointFunction = missing_class("deepspeed.checkpointing.CheckpointFunction", _FEATURE)


def is_configured() -> bool:
    """False: activation checkpointing cannot be configured in this version."""
    return False


__all__ = ["CheckpointFunction", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
           "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint", "partition_activations_in_checkpoint",
           "reset", "set_num_layers"]
