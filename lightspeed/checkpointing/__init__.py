"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`): `configure`,
`checkpoint`, `non_reentrant_checkpoint`, `is_configured`, `reset`, the RNG tracker
(`get_cuda_rng_tracker`, `model_parallel_cuda_manual_seed`, `CudaRNGStatesTracker`), and
`apply_activation_checkpointing`, the engine's step that honours the config's
`activation_checkpointing` block.

`rng.py` holds the random state, `saved_inputs.py` how a checkpoint keeps its inputs (whole, on the
host, partitioned over the model-parallel group), `settings.py` the process-wide settings, and
`function.py` the two checkpoint functions. Layer: above comm/ (the partition all-gather), below
zero/ and runtime/.
"""

from __future__ import annotations

from typing import Any

from lightspeed._utils.logging import get_logger
from lightspeed.checkpointing.function import CheckpointFunction, checkpoint, non_reentrant_checkpoint
from lightspeed.checkpointing.rng import (
    MODEL_PARALLEL_RNG_TRACKER_NAME, CudaRNGStatesTracker, get_cuda_rng_tracker, seed_model_parallel,
)  # fmt: skip
from lightspeed.checkpointing.settings import (
    SETTINGS, CheckpointOptions, apply_activation_checkpointing, configure, is_configured,
    partition_activations_in_checkpoint, reset, set_num_layers,
)  # fmt: skip

logger = get_logger(__name__)


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """DeepSpeed's (Megatron's) seeding: the device generator gets `seed` (the same on every rank of a
    model-parallel group, so dropout outside model-parallel regions agrees), and the tracker's
    "model-parallel-rng" state gets `seed + 2718 + tensor-parallel rank` (different on each). The rank
    comes from the mpu given to `configure()` (0 without one)."""
    mpu: Any = SETTINGS.mpu
    tp_rank = SETTINGS.model_parallel.rank if mpu is not None else 0
    dp_seed, mp_seed = seed_model_parallel(seed, tp_rank)
    dp_rank = mpu.get_data_parallel_rank() if hasattr(mpu, "get_data_parallel_rank") else None
    logger.info("model-parallel seeds: tensor-parallel rank %d, data-parallel rank %s: model-parallel seed %d, "
                "data-parallel seed %d", tp_rank, dp_rank, mp_seed, dp_seed)


__all__ = ["MODEL_PARALLEL_RNG_TRACKER_NAME", "CheckpointFunction", "CheckpointOptions", "CudaRNGStatesTracker",
           "apply_activation_checkpointing", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
           "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint", "partition_activations_in_checkpoint",
           "reset", "set_num_layers"]
