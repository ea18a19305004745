"""`deepspeed.runtime.zero.stage_1_and_2`: `DeepSpeedZeroOptimizer`, DeepSpeed's optimizer wrapper for ZeRO stages 1 and 2 (`_missing.optimizer_wrapper_class`)."""

from lightspeed.compat.deepspeed._missing import optimizer_wrapper_class

DeepSpeedZeroOptimizer = optimizer_wrapper_class("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "ZeRO stages 1 and 2")

__all__ = ["DeepSpeedZeroOptimizer"]
