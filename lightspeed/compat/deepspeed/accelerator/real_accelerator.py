"""`deepspeed.accelerator.real_accelerator` (where DeepSpeed defines `get_accelerator`)."""

from lightspeed.compat.deepspeed.accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
