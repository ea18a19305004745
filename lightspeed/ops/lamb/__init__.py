"""LAMB family (mirrors deepspeed.ops.lamb)."""
from .fused_lamb import FusedLamb
from .reference import lamb_step

__all__ = ["FusedLamb", "lamb_step"]
