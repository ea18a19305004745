"""Lion family (mirrors deepspeed.ops.lion)."""
from .cpu_lion import CPULion, DeepSpeedCPULion
from .reference import lion_step

__all__ = ["CPULion", "DeepSpeedCPULion", "lion_step"]
