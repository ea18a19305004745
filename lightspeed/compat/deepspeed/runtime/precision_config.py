"""`deepspeed.runtime.precision_config`: DeepSpeed's models of the `fp16` and `bf16` sections
(`DeepSpeedFP16Config`, `DeepSpeedBF16Config`) and the functions that read them from a config dict.

The models are lightspeed's sections (lightspeed/config/precision.py: the keys, defaults and checks,
which are DeepSpeed's), with the one method DeepSpeed's fp16 model adds. Must not hold any rule of its own.
"""

from __future__ import annotations

from lightspeed.config.precision import BF16Config, FP16Config

FP16 = "fp16"
BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"  # DeepSpeed's older name of the bf16 section


class DeepSpeedFP16Config(FP16Config):
    """DeepSpeed's `fp16` section model (lightspeed's `FP16Config`)."""

    def dynamic_loss_scale_args(self) -> dict:
        """The dynamic loss scaler's arguments under DeepSpeed's names (its fp16/loss_scaler.py keys)."""
        return {"init_scale": 2**self.initial_scale_power, "scale_window": self.loss_scale_window,
                "delayed_shift": self.hysteresis, "consecutive_hysteresis": self.consecutive_hysteresis,
                "min_scale": self.min_loss_scale}


class DeepSpeedBF16Config(BF16Config):
    """DeepSpeed's `bf16` section model (lightspeed's `BF16Config`)."""


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    """The `fp16` section of a config dict (defaults when absent)."""
    return DeepSpeedFP16Config(**param_dict.get(FP16, {}))


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    """The `bf16` section of a config dict, else its older name `bfloat16` (defaults when neither)."""
    section = param_dict.get(BFLOAT16)
    if section is None:
        section = param_dict.get(BFLOAT16_OLD, {})
    return DeepSpeedBF16Config(**section)


__all__ = ["BFLOAT16", "BFLOAT16_OLD", "DeepSpeedBF16Config", "DeepSpeedFP16Config", "FP16", "get_bfloat16_config",
           "get_float16_config"]
