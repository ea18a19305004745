"""`deepspeed.runtime`: the engine, the hybrid engine, config, data loader, LR schedules and ZeRO under
DeepSpeed's module paths. Submodules load on first use."""

import importlib

_SUBMODULES = ("activation_checkpointing", "config", "config_utils", "dataloader", "engine", "hybrid_engine", "lr_schedules", "pipe",
               "precision_config", "sequence_parallel", "utils", "zero")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'deepspeed.runtime' (lightspeed) has no attribute {name!r}")
