"""`deepspeed.runtime.zero.offload_config`: DeepSpeed's models of the `offload_param` and
`offload_optimizer` blocks (lightspeed's sections, lightspeed/config/zero.py, whose keys and defaults
are DeepSpeed's) and its enums of offload devices and offloadable state."""

from __future__ import annotations

from enum import Enum

from lightspeed.config.zero import OffloadOptimizerConfig, OffloadParamConfig


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state lives (a `str`: equal to the section's `device` string)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's names of the ZeRO buffers `engine.offload_states` can move."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class DeepSpeedZeroOffloadParamConfig(OffloadParamConfig):
    """DeepSpeed's `zero_optimization.offload_param` model (lightspeed's `OffloadParamConfig`)."""


class DeepSpeedZeroOffloadOptimizerConfig(OffloadOptimizerConfig):
    """DeepSpeed's `zero_optimization.offload_optimizer` model (lightspeed's `OffloadOptimizerConfig`)."""


__all__ = ["DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig", "OffloadDeviceEnum",
           "OffloadStateTypeEnum"]
