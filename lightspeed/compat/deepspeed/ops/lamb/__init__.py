"""`deepspeed.ops.lamb`: FusedLamb (lightspeed.ops.lamb)."""

from lightspeed.ops.lamb import FusedLamb

__all__ = ["FusedLamb"]
