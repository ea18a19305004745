"""`deepspeed.moe`: DeepSpeed's mixture-of-experts training API over lightspeed's
(`lightspeed.parallel.experts`): `layer.MoE`, `sharded_moe` (the gates and `MOELayer`), `experts.Experts`
and `utils` (the expert-parameter tests and the optimizer-group split). Submodules load on first use."""

import importlib

_SUBMODULES = ("experts", "layer", "sharded_moe", "utils")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'deepspeed.moe' (lightspeed) has no attribute {name!r}")
