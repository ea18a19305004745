"""`deepspeed.checkpoint`: `utils` (`clone_tensors_for_torch_save`, the per-rank file names). DeepSpeed's
universal-checkpoint tools (`DeepSpeedCheckpoint`, ds_to_universal) are not built: lightspeed's engine loads
any checkpoint at any world size and stage without a conversion step, and `deepspeed.utils.zero_to_fp32`
consolidates."""

import importlib

from lightspeed.compat.deepspeed._missing import missing_class

DeepSpeedCheckpoint = missing_class("deepspeed.checkpoint.DeepSpeedCheckpoint",
                                    "reading DeepSpeed's checkpoint layout offline (universal checkpoints)")


def __getattr__(name: str):
    if name == "utils":
        return importlib.import_module(f"{__name__}.utils")
    raise AttributeError(f"module 'deepspeed.checkpoint' (lightspeed) has no attribute {name!r}")
