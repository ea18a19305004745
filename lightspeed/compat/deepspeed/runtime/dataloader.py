"""`deepspeed.runtime.dataloader`: `RepeatingLoader` (lightspeed/runtime/dataloader.py)."""

from lightspeed.runtime.dataloader import RepeatingLoader

__all__ = ["RepeatingLoader"]
