"""Optimizers and LR schedules built from the ds_config `optimizer` and `scheduler` sections."""

from lightspeed.optim.factory import build_optimizer
from lightspeed.optim.schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "build_optimizer",
    "build_scheduler",
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
]
