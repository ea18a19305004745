"""`deepspeed.checkpointing` (DeepSpeed's `runtime.activation_checkpointing.checkpointing`): re-exports
of `lightspeed.checkpointing`."""

from lightspeed.checkpointing import (  # noqa: F401
    CheckpointFunction, CudaRNGStatesTracker, checkpoint, configure, get_cuda_rng_tracker, is_configured,
    model_parallel_cuda_manual_seed, non_reentrant_checkpoint, partition_activations_in_checkpoint, reset,
    set_num_layers,
)  # fmt: skip
from lightspeed.checkpointing.rng import (  # noqa: F401
    MODEL_PARALLEL_RNG_TRACKER_NAME as _MODEL_PARALLEL_RNG_TRACKER_NAME,
)

__all__ = ["CheckpointFunction", "CudaRNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker",
           "is_configured", "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint",
           "partition_activations_in_checkpoint", "reset", "set_num_layers"]
