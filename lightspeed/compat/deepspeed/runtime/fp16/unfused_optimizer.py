"""`deepspeed.runtime.fp16.unfused_optimizer`: `FP16_UnfusedOptimizer`, DeepSpeed's optimizer wrapper for fp16 at ZeRO stage 0 with another optimizer (`_missing.optimizer_wrapper_class`)."""

from lightspeed.compat.deepspeed._missing import optimizer_wrapper_class

FP16_UnfusedOptimizer = optimizer_wrapper_class("deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer", "fp16 at ZeRO stage 0 with another optimizer")

__all__ = ["FP16_UnfusedOptimizer"]
