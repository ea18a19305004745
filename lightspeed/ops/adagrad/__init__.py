"""Adagrad family (mirrors deepspeed.ops.adagrad)."""
from .cpu_adagrad import CPUAdagrad, DeepSpeedCPUAdagrad
from .fused_adagrad import FusedAdagrad
from .reference import adagrad_step

__all__ = ["FusedAdagrad", "CPUAdagrad", "DeepSpeedCPUAdagrad", "adagrad_step"]
