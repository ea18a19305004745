"""Adam family (mirrors deepspeed.ops.adam)."""
from .cpu_adam import CPUAdam, DeepSpeedCPUAdam
from .fused_adam import FusedAdam
from .reference import adam_step

__all__ = ["CPUAdam", "DeepSpeedCPUAdam", "FusedAdam", "adam_step"]
