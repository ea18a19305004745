"""`deepspeed.runtime.fp16.fused_optimizer`: `FP16_Optimizer`, DeepSpeed's optimizer wrapper for fp16 at ZeRO stage 0 with a fused optimizer (`_missing.optimizer_wrapper_class`)."""

from lightspeed.compat.deepspeed._missing import optimizer_wrapper_class

FP16_Optimizer = optimizer_wrapper_class("deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer", "fp16 at ZeRO stage 0 with a fused optimizer")

__all__ = ["FP16_Optimizer"]
