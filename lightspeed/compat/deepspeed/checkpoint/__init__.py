"""`deepspeed.checkpoint`: `utils.clone_tensors_for_torch_save`. DeepSpeed's offline converters
(zero_to_fp32, ds_to_universal) are later lightspeed features."""

import importlib


def __getattr__(name: str):
    if name == "utils":
        return importlib.import_module(f"{__name__}.utils")
    if name in ("zero_to_fp32", "ds_to_universal", "universal_checkpoint", "DeepSpeedCheckpoint"):
        raise NotImplementedError(f"deepspeed.checkpoint.{name}: converting checkpoints offline (zero_to_fp32, "
                                  "universal checkpoints) is not implemented in lightspeed yet")
    raise AttributeError(f"module 'deepspeed.checkpoint' (lightspeed) has no attribute {name!r}")
