"""`deepspeed.runtime.fp16.unfused_optimizer`: `FP16_UnfusedOptimizer`.

DeepSpeed wraps the client's optimizer in this class for fp16 at ZeRO stage 0 with another optimizer; lightspeed's engine
steps the optimizer itself (its ZeRO strategies own what the wrapper holds), so the class exists for
code that imports it or tests `isinstance(engine.optimizer, ...)` (False: `engine.optimizer` is the
client's optimizer, also under ZeRO), and constructing it directly raises NotImplementedError.
"""

from lightspeed.compat.deepspeed._missing import missing_class

FP16_UnfusedOptimizer = missing_class(
    "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer",
    "constructing DeepSpeed's optimizer wrapper directly (deepspeed.initialize builds the engine, whose strategy "
    "steps the optimizer)")

__all__ = ["FP16_UnfusedOptimizer"]
