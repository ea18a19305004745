"""`deepspeed.zero`: lightspeed.zero's public names (`Init`, `GatheredParameters`,
`register_external_parameter`, ...), forwarded so that every name lightspeed.zero exports is here too."""

import lightspeed.zero as _zero
from lightspeed.compat.deepspeed._missing import missing_class

MiCS_Init = missing_class("deepspeed.zero.MiCS_Init", "MiCS (ZeRO-3 sharding within sub-groups)")
TiledLinear = missing_class("deepspeed.zero.TiledLinear", "tiled linear layers (zero.TiledLinear)")
TiledLinearReturnBias = missing_class("deepspeed.zero.TiledLinearReturnBias", "tiled linear layers (zero.TiledLinear)")

__all__ = [*_zero.__all__, "MiCS_Init", "TiledLinear", "TiledLinearReturnBias"]


def __getattr__(name: str):
    if name in _zero.__all__:
        return getattr(_zero, name)
    if name == "partition_parameters":
        import importlib

        return importlib.import_module("lightspeed.compat.deepspeed.runtime.zero.partition_parameters")
    raise AttributeError(f"module 'deepspeed.zero' (lightspeed) has no attribute {name!r}")
