"""Adam family (mirrors deepspeed.ops.adam)."""
from .cpu_adam import CPUAdam, DeepSpeedCPUAdam
from .reference import adam_step

__all__ = ["CPUAdam", "DeepSpeedCPUAdam", "adam_step"]
