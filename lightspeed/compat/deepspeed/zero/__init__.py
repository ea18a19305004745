"""`deepspeed.zero`: lightspeed.zero's public names (`Init`, `GatheredParameters`,
`register_external_parameter`, ...), forwarded so that every name lightspeed.zero exports is here too,
and `unwrap_model_for_generation` (runtime/zero/stage3.py)."""

import lightspeed.zero as _zero
from lightspeed.compat.deepspeed._missing import missing_class

MiCS_Init = missing_class("deepspeed.zero.MiCS_Init", "MiCS (ZeRO-3 sharding within sub-groups)")
TiledLinear = missing_class("deepspeed.zero.TiledLinear", "tiled linear layers (zero.TiledLinear)")
TiledLinearReturnBias = missing_class("deepspeed.zero.TiledLinearReturnBias", "tiled linear layers (zero.TiledLinear)")

__all__ = [*_zero.__all__, "DeepSpeedZeRoOffload", "MiCS_Init", "TiledLinear", "TiledLinearReturnBias",
           "ZeroParamStatus", "ZeroParamType", "unwrap_model_for_generation"]


def __getattr__(name: str):
    if name in _zero.__all__:
        return getattr(_zero, name)
    if name in ("partition_parameters", "config", "offload_config", "stage3", "parameter_offload"):
        import importlib

        return importlib.import_module(f"lightspeed.compat.deepspeed.runtime.zero.{name}")
    if name in ("ZeroParamStatus", "ZeroParamType"):  # DeepSpeed's runtime/zero/__init__.py re-exports these
        from lightspeed.compat.deepspeed.runtime.zero import partition_parameters

        return getattr(partition_parameters, name)
    if name == "DeepSpeedZeRoOffload":
        from lightspeed.compat.deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

        return DeepSpeedZeRoOffload
    if name == "unwrap_model_for_generation":
        from lightspeed.compat.deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        return unwrap_model_for_generation
    raise AttributeError(f"module 'deepspeed.zero' (lightspeed) has no attribute {name!r}")
