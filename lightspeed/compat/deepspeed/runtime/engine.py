"""`deepspeed.runtime.engine`: `DeepSpeedEngine` is lightspeed's engine class; the optimizer-name
constants DeepSpeed's engine module imports from its config module."""

from lightspeed.compat.deepspeed.runtime.config import (ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER,
                                                        DEEPSPEED_OPTIMIZERS, LAMB_OPTIMIZER, LION_OPTIMIZER,
                                                        MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUON_OPTIMIZER,
                                                        MUSGD_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER,
                                                        ZERO_ONE_ADAM_OPTIMIZER)
from lightspeed.runtime.engine import LightspeedEngine as DeepSpeedEngine

__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "DEEPSPEED_OPTIMIZERS", "DeepSpeedEngine",
           "LAMB_OPTIMIZER", "LION_OPTIMIZER", "MUADAMW_OPTIMIZER", "MUADAM_OPTIMIZER", "MUON_OPTIMIZER",
           "MUSGD_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER", "ONEBIT_LAMB_OPTIMIZER", "ZERO_ONE_ADAM_OPTIMIZER"]
