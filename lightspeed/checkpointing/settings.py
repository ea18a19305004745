"""How activation checkpoints are kept: DeepSpeed's `configure()` and the `activation_checkpointing`
config block, the model-parallel group taken from an `mpu`, and the engine's entry point.

Owns: the process-wide settings DeepSpeed's module-level API implies (one `configure()` per process,
read by every `checkpoint()` call) and the contiguous buffers they may need. Must not: run or
recompute anything (`function.py` does), or build process groups (the `mpu` hands them in).

Note (what the engine does with the config block): DeepSpeed's engine does not read
`activation_checkpointing` and wraps no module: the block takes effect when the program calls
`deepspeed.checkpointing.configure(mpu, deepspeed_config=...)` and then `checkpoint()` around the
layers it chooses (Megatron's `set_deepspeed_activation_checkpointing`). `apply_activation_checkpointing`
does the same and one thing more: when the block sets anything and the program has not called
`configure()` itself, it configures from the block with the engine's `mpu`, so the keys are honoured
by every later `checkpoint()` call without that extra line. It leaves the model unchanged; choosing
what to checkpoint stays with the model (`checkpoint()`, or Hugging Face's
`gradient_checkpointing_enable()`, which uses torch.utils.checkpoint).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from lightspeed._utils.logging import get_logger
from lightspeed.checkpointing.saved_inputs import ContiguousPartitions, ModelParallel
from lightspeed.config.errors import ConfigError
from lightspeed.config.features import ActivationCheckpointingConfig
from lightspeed.config.loader import load

logger = get_logger(__name__)


@dataclass(frozen=True)
class CheckpointOptions:
    """The `activation_checkpointing` keys, as `checkpoint()` reads them (DeepSpeed's names in comments)."""

    partition_activations: bool = False  # PARTITION_ACTIVATIONS
    contiguous_memory_optimization: bool = False  # CONTIGUOUS_CHECKPOINTING
    cpu_checkpointing: bool = False  # CPU_CHECKPOINT
    number_checkpoints: int | None = None  # num_layers
    synchronize_checkpoint_boundary: bool = False  # SYNCHRONIZE
    profile: bool = False  # PROFILE_TIME

    @classmethod
    def from_section(cls, section: ActivationCheckpointingConfig) -> "CheckpointOptions":
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})

    def check(self) -> None:
        """DeepSpeed's rules across the keys, as one-line ConfigErrors (ValueErrors) naming them."""
        n = self.number_checkpoints
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ConfigError(f"activation_checkpointing.number_checkpoints must be a positive integer (got {n!r})")
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ConfigError("activation_checkpointing.contiguous_memory_optimization needs "
                              "activation_checkpointing.partition_activations (it lays out the partitions)")
        if self.contiguous_memory_optimization and not n:
            raise ConfigError("activation_checkpointing.contiguous_memory_optimization needs "
                              "activation_checkpointing.number_checkpoints (the buffers hold that many checkpoints)")


class _Settings:
    """The one set of settings of this process."""

    def __init__(self):
        self.options = CheckpointOptions()
        self.mpu: Any = None
        self.model_parallel = ModelParallel.none()
        self.configured = False
        self.contiguous = ContiguousPartitions()


SETTINGS = _Settings()


def _section_from(deepspeed_config: Any, mpu: Any) -> ActivationCheckpointingConfig:
    """The `activation_checkpointing` section of a config given as a dict, a JSON/HJSON path or string,
    a loaded `LightspeedConfig`, or DeepSpeed's `DeepSpeedConfig` object."""
    section = getattr(deepspeed_config, "activation_checkpointing", None)
    if isinstance(section, ActivationCheckpointingConfig):
        return section
    section = getattr(deepspeed_config, "activation_checkpointing_config", None)
    if isinstance(section, ActivationCheckpointingConfig):
        return section
    # the batch triad is checked against the data-parallel size, which an mpu may make smaller than the world
    dp_size = mpu.get_data_parallel_world_size() if hasattr(mpu, "get_data_parallel_world_size") else None
    return load(deepspeed_config, world_size=dp_size, check_support=False).activation_checkpointing


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's `deepspeed.checkpointing.configure`: start from the defaults, read the config's
    `activation_checkpointing` block when `deepspeed_config` is given, then apply each argument that
    is not None over it.

    mpu_: a Megatron-style object whose model-parallel group activations are partitioned over
        (`get_tensor_model_parallel_group/_rank/_world_size`, else `get_model_parallel_*`); None keeps
        the one given before (none at first: a group of one).
    The keyword arguments override, in order, partition_activations, contiguous_memory_optimization,
    number_checkpoints, cpu_checkpointing, synchronize_checkpoint_boundary and profile.
    """
    if mpu_ is not None:
        SETTINGS.mpu = mpu_
    options = CheckpointOptions()
    if deepspeed_config is not None:
        options = CheckpointOptions.from_section(_section_from(deepspeed_config, SETTINGS.mpu))
    overrides = {"partition_activations": partition_activations,
                 "contiguous_memory_optimization": contiguous_checkpointing, "number_checkpoints": num_checkpoints,
                 "cpu_checkpointing": checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize,
                 "profile": profile}
    options = dataclasses.replace(options, **{k: v for k, v in overrides.items() if v is not None})
    options.check()
    SETTINGS.model_parallel = ModelParallel.from_mpu(SETTINGS.mpu)
    SETTINGS.options = options
    SETTINGS.contiguous.clear()
    SETTINGS.configured = True
    logger.info("activation checkpointing: %s, model-parallel size %d", ", ".join(
        f"{f.name}={getattr(options, f.name)}" for f in dataclasses.fields(options)), SETTINGS.model_parallel.size)


def is_configured() -> bool:
    """True once `configure()` has been called (DeepSpeed's `is_configured`)."""
    return SETTINGS.configured


def reset() -> None:
    """Drop the contiguous buffers (DeepSpeed's `reset`: call it after forwards that had no backward,
    e.g. evaluation, when contiguous_memory_optimization is on; otherwise it does nothing)."""
    SETTINGS.contiguous.clear()


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """Turn partitioning of the checkpointed inputs on or off (DeepSpeed's setter)."""
    options = dataclasses.replace(SETTINGS.options, partition_activations=bool(partition_activation))
    options.check()
    SETTINGS.options = options


def set_num_layers(nlayers: int) -> None:
    """Set number_checkpoints (DeepSpeed's setter; the contiguous buffers hold that many)."""
    options = dataclasses.replace(SETTINGS.options, number_checkpoints=nlayers)
    options.check()
    SETTINGS.options = options
    SETTINGS.contiguous.clear()


def apply_activation_checkpointing(model: torch.nn.Module, config: Any, mpu: Any = None) -> torch.nn.Module:
    """The engine's activation-checkpointing step (see the Note above): configure this process's
    `checkpoint()` from `config`'s `activation_checkpointing` block when the block sets anything and
    `configure()` has not been called; the model is returned unchanged."""
    section = _section_from(config, mpu)
    changed = section.non_default()
    if not changed:
        return model
    if SETTINGS.configured:
        logger.info("activation_checkpointing (%s): configure() was already called; its settings stand",
                    ", ".join(sorted(changed)))
        return model
    configure(mpu, deepspeed_config=config)
    return model
