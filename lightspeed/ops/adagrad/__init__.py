"""Adagrad family (mirrors deepspeed.ops.adagrad)."""
from .cpu_adagrad import CPUAdagrad, DeepSpeedCPUAdagrad
from .reference import adagrad_step

__all__ = ["CPUAdagrad", "DeepSpeedCPUAdagrad", "adagrad_step"]
