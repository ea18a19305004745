"""`deepspeed.sequence`: Ulysses `DistributedAttention` (`deepspeed.sequence.layer`)."""

import importlib


def __getattr__(name: str):
    if name == "layer":
        return importlib.import_module(f"{__name__}.layer")
    raise AttributeError(f"module 'deepspeed.sequence' (lightspeed) has no attribute {name!r}")
