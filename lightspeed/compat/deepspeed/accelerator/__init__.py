"""`deepspeed.accelerator`: `get_accelerator()`, lightspeed's accelerator object (`lightspeed/_utils/accelerator.py`)."""

from lightspeed._utils.accelerator import get_accelerator


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in ("cuda", "cpu")


def set_accelerator(accel_obj) -> None:
    raise NotImplementedError("deepspeed.accelerator.set_accelerator: lightspeed's accelerator is chosen from the "
                              "device (CUDA, or CPU with LIGHTSPEED_ACCELERATOR=cpu); custom accelerators are not "
                              "supported")


__all__ = ["get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
