"""`deepspeed.runtime.zero.stage_1_and_2`: `DeepSpeedZeroOptimizer`.

DeepSpeed wraps the client's optimizer in this class for ZeRO stages 1 and 2; lightspeed's engine
steps the optimizer itself (its ZeRO strategies own what the wrapper holds), so the class exists for
code that imports it or tests `isinstance(engine.optimizer, ...)` (False: `engine.optimizer` is the
client's optimizer, also under ZeRO), and constructing it directly raises NotImplementedError.
"""

from lightspeed.compat.deepspeed._missing import missing_class

DeepSpeedZeroOptimizer = missing_class(
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "constructing DeepSpeed's optimizer wrapper directly (deepspeed.initialize builds the engine, whose strategy "
    "steps the optimizer)")

__all__ = ["DeepSpeedZeroOptimizer"]
