"""`deepspeed.ops.lion`: FusedLion and DeepSpeedCPULion (lightspeed.ops.lion)."""

from lightspeed.ops.lion import DeepSpeedCPULion, FusedLion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
