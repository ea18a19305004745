"""`deepspeed.zero`: lightspeed.zero's public names (`Init`, `GatheredParameters`,
`register_external_parameter`, ...), forwarded so that every name lightspeed.zero exports is here too."""

import lightspeed.zero as _zero

__all__ = list(_zero.__all__)


def __getattr__(name: str):
    if name in _zero.__all__:
        return getattr(_zero, name)
    if name == "partition_parameters":
        import importlib

        return importlib.import_module("lightspeed.compat.deepspeed.runtime.zero.partition_parameters")
    if name in ("MiCS_Init", "TiledLinear", "TiledLinearReturnBias"):
        raise NotImplementedError(f"deepspeed.zero.{name}: not implemented in lightspeed yet")
    raise AttributeError(f"module 'deepspeed.zero' (lightspeed) has no attribute {name!r}")
