"""`deepspeed.runtime.fp16.loss_scaler`: the static and dynamic loss scalers (lightspeed's, with
DeepSpeed's update rule: lightspeed/precision/loss_scaler.py) under DeepSpeed's class names."""

from lightspeed.precision.loss_scaler import DynamicLossScaler, StaticLossScaler

LossScaler = StaticLossScaler

__all__ = ["DynamicLossScaler", "LossScaler"]
