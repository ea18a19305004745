"""The ``optimizer`` and ``scheduler`` sections: ``{"type": name, "params": {...}}``.

`params` stays a free dict on purpose: the optimizer and scheduler factories (``lightspeed.optim``)
know each constructor's signature and validate the params themselves. This module owns only the
block shape and the name lists DeepSpeed matches `type` against (case-insensitively for optimizers).
"""

from __future__ import annotations

from typing import Optional

from lightspeed.config.base import Bool, FreeDict, Section, Str

# DeepSpeed's own optimizer names (runtime/config.py DEEPSPEED_OPTIMIZERS); any other `type` is
# looked up in torch.optim by DeepSpeed.
DEEPSPEED_OPTIMIZERS = (
    "adagrad", "adam", "adamw", "lamb", "onebitadam", "onebitlamb", "zerooneadam",
    "muadam", "muadamw", "musgd", "lion", "muon",
)  # fmt: skip

# DeepSpeed's schedulers (runtime/lr_schedules.py); other names are looked up in torch.optim.lr_scheduler.
DEEPSPEED_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


class OptimizerConfig(Section):
    """``optimizer``: which optimizer the engine builds and its constructor arguments."""

    type: Str
    params: FreeDict = {}
    legacy_fusion: Bool = False
    # lightspeed's own: the fused ZeRO step's launches captured once in a CUDA graph (zero/graphed_step.py)
    cuda_graph: Bool = False

    @property
    def name(self) -> str:
        """`type` lower-cased when it is one of DeepSpeed's names (as DeepSpeed does), else as given."""
        lowered = self.type.lower()
        return lowered if lowered in DEEPSPEED_OPTIMIZERS else self.type


class SchedulerConfig(Section):
    """``scheduler``: which learning-rate schedule the engine builds and its arguments."""

    type: Str
    params: FreeDict = {}


def optimizer_name(cfg_optimizer: Optional[OptimizerConfig]) -> Optional[str]:
    return cfg_optimizer.name if cfg_optimizer is not None else None
