"""`deepspeed.runtime.engine`: `DeepSpeedEngine` is lightspeed's engine class; the optimizer-name
constants DeepSpeed's engine module imports from its config module, and its type aliases of the
`optimizer` / `lr_scheduler` callables `initialize` takes."""

from typing import Callable, Dict, Iterable, Union

from torch.nn import Parameter
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightspeed.compat.deepspeed.runtime.config import (ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER,
                                                        DEEPSPEED_OPTIMIZERS, LAMB_OPTIMIZER, LION_OPTIMIZER,
                                                        MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUON_OPTIMIZER,
                                                        MUSGD_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER,
                                                        ZERO_ONE_ADAM_OPTIMIZER)
from lightspeed.runtime.engine import LightspeedEngine as DeepSpeedEngine

DeepSpeedOptimizerCallable = Callable[[Union[Iterable[Parameter], Dict[str, Iterable]]], Optimizer]
DeepSpeedSchedulerCallable = Callable[[Optimizer], LRScheduler]

__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "DEEPSPEED_OPTIMIZERS", "DeepSpeedEngine",
           "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable",
           "LAMB_OPTIMIZER", "LION_OPTIMIZER", "MUADAMW_OPTIMIZER", "MUADAM_OPTIMIZER", "MUON_OPTIMIZER",
           "MUSGD_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER", "ONEBIT_LAMB_OPTIMIZER", "ZERO_ONE_ADAM_OPTIMIZER"]
