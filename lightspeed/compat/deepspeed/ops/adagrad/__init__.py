"""`deepspeed.ops.adagrad`: DeepSpeedCPUAdagrad (lightspeed.ops.adagrad)."""

from lightspeed.ops.adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
