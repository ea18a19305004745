"""`deepspeed.ops.adam`: FusedAdam and DeepSpeedCPUAdam (lightspeed.ops.adam)."""

from lightspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
