"""Optimizers and LR schedules built from the ds_config `optimizer` and `scheduler` sections.

`factory.py` (`build_optimizer`: DeepSpeed's names to lightspeed.ops' fused optimizers, their CPU
kernels under optimizer offload, `torch_adam` and other names to torch.optim, the one-bit optimizers
over a `OneBitAllReduce` on the data-parallel communicator), `schedules.py` (DeepSpeed's five schedules,
`build_scheduler`, `scheduled_steps`: the run's length when the schedule knows it, for the engine's ETA),
`validation.py` (`validate_training_config`: the one check `initialize` and `lightspeed config check`
run, the optimizer and scheduler built over probe parameters), `onebit/` (1-bit Adam, 0/1 Adam, 1-bit
LAMB, stage 0 only). Must not: wrap an optimizer for ZeRO, or know the engine."""

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
