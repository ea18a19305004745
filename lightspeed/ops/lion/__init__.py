"""Lion family (mirrors deepspeed.ops.lion)."""
from .cpu_lion import CPULion, DeepSpeedCPULion
from .fused_lion import FusedLion
from .reference import lion_step

__all__ = ["FusedLion", "CPULion", "DeepSpeedCPULion", "lion_step"]
