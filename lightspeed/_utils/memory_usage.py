"""`see_memory_usage(message, force)`: log the accelerator's and the host's memory use at a point in a
script (DeepSpeed's `deepspeed.runtime.utils.see_memory_usage`), then reset the accelerator's peak."""

from __future__ import annotations

import gc

from lightspeed._utils.accelerator import CpuAccelerator, get_accelerator
from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)

_GB = 1024**3


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log `message` with allocated / peak / reserved accelerator memory and host memory in use (rank 0
    only, through the rank-aware logger), then reset the accelerator's peak statistics. Does nothing
    unless `force` (DeepSpeed's switch for its many call sites)."""
    if not force:
        return
    gc.collect()
    accel = get_accelerator()
    logger.info(message)
    logger.info(f"MA {accel.memory_allocated() / _GB:.2f} GB  Max_MA {accel.max_memory_allocated() / _GB:.2f} GB  "
                f"CA {accel.memory_reserved() / _GB:.2f} GB  Max_CA {accel.max_memory_reserved() / _GB:.2f} GB")
    host = CpuAccelerator()  # the machine's memory, whatever the training device
    total, available = host.total_memory(), host.available_memory()
    logger.info(f"CPU Virtual Memory:  used = {(total - available) / _GB:.2f} GB, "
                f"percent = {100 * (total - available) / total:.1f}%")
    accel.reset_peak_memory_stats()
