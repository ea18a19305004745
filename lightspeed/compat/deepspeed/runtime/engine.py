"""`deepspeed.runtime.engine`: `DeepSpeedEngine` is lightspeed's engine class."""

from lightspeed.runtime.engine import LightspeedEngine as DeepSpeedEngine

ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"

__all__ = ["ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "DeepSpeedEngine", "LAMB_OPTIMIZER", "LION_OPTIMIZER"]
