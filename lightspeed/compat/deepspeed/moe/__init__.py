"""`deepspeed.moe`: mixture-of-experts training is not built in lightspeed yet. The modules exist so
scripts that import them at top level run: `layer.MoE` raises NotImplementedError when constructed,
and `utils` answers the parameter questions for models without DeepSpeed MoE layers (all of them,
here). Submodules load on first use."""

import importlib

_SUBMODULES = ("layer", "utils")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'deepspeed.moe' (lightspeed) has no attribute {name!r}")
