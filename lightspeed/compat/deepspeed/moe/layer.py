"""`deepspeed.moe.layer`: DeepSpeed's `MoE` layer, whose construction raises NotImplementedError
(mixture-of-experts training, with its expert-parallel groups, is not built)."""

from lightspeed.compat.deepspeed._missing import missing_class

MoE = missing_class("deepspeed.moe.layer.MoE", "mixture-of-experts training (the MoE layer and expert parallelism)")

__all__ = ["MoE"]
