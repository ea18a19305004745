"""`deepspeed.runtime.zero.config`: DeepSpeed's model of the `zero_optimization` section,
`DeepSpeedZeroConfig`, and `ZeroStageEnum`.

The model is lightspeed's `ZeroConfig` (lightspeed/config/zero.py: keys, defaults, checks) adapted to
DeepSpeed's names: it is built from either spelling of the stage-3 knobs and the deprecated keys
(lightspeed/config/legacy.py rewrites them, as for a whole config), and reads under DeepSpeed's field
names (`prefetch_bucket_size` for `stage3_prefetch_bucket_size`, ...: `STAGE3_ALIASES`). Must not hold
any rule of its own.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

from pydantic import model_validator

from lightspeed.compat.deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                                    DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum)
from lightspeed.config.errors import ConfigError
from lightspeed.config.legacy import map_legacy
from lightspeed.config.zero import STAGE3_ALIASES, ZeroConfig


class ZeroStageEnum(int, Enum):
    """The ZeRO stages (an `int`: equal to the section's `stage`)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


def _alias(json_name: str) -> property:
    return property(lambda self: getattr(self, json_name), doc=f"DeepSpeed's name of `{json_name}`.")


class DeepSpeedZeroConfig(ZeroConfig):
    """DeepSpeed's `zero_optimization` model: `DeepSpeedZeroConfig(**section)`."""

    offload_param: Optional[DeepSpeedZeroOffloadParamConfig] = None
    offload_optimizer: Optional[DeepSpeedZeroOffloadOptimizerConfig] = None

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_names(cls, data):
        if not isinstance(data, dict):
            return data
        mapped, problems = map_legacy({"zero_optimization": data})
        if problems:
            raise ConfigError(problems)
        return mapped["zero_optimization"]

    # DeepSpeed's field names of the stage-3 knobs (its JSON names are their aliases)
    prefetch_bucket_size = _alias(STAGE3_ALIASES["prefetch_bucket_size"])
    param_persistence_threshold = _alias(STAGE3_ALIASES["param_persistence_threshold"])
    model_persistence_threshold = _alias(STAGE3_ALIASES["model_persistence_threshold"])
    max_live_parameters = _alias(STAGE3_ALIASES["max_live_parameters"])
    max_reuse_distance = _alias(STAGE3_ALIASES["max_reuse_distance"])
    gather_16bit_weights_on_model_save = _alias(STAGE3_ALIASES["gather_16bit_weights_on_model_save"])
    module_granularity_threshold = _alias(STAGE3_ALIASES["module_granularity_threshold"])
    use_all_reduce_for_fetch_params = _alias(STAGE3_ALIASES["use_all_reduce_for_fetch_params"])
    allgather_sequential = _alias(STAGE3_ALIASES["allgather_sequential"])


__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "OffloadDeviceEnum", "ZeroStageEnum"]
