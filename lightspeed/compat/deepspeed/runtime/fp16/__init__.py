"""`deepspeed.runtime.fp16`: DeepSpeed's stage-0 fp16 optimizer wrappers by their module paths
(`fused_optimizer.FP16_Optimizer`, `unfused_optimizer.FP16_UnfusedOptimizer`) and `loss_scaler`'s
classes (lightspeed/precision/loss_scaler.py). Submodules load on first use."""

import importlib

_SUBMODULES = ("fused_optimizer", "loss_scaler", "unfused_optimizer")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'deepspeed.runtime.fp16' (lightspeed) has no attribute {name!r}")
