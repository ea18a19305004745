"""`deepspeed.runtime.utils`: `see_memory_usage` (lightspeed/_utils/memory_usage.py)."""

from lightspeed._utils.memory_usage import see_memory_usage

__all__ = ["see_memory_usage"]
