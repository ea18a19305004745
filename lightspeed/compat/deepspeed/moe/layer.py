"""`deepspeed.moe.layer`: DeepSpeed's `MoE` layer (lightspeed.parallel.experts.MoE): forward returns
(output, l_aux, exp_counts); `initialize()` binds its expert-parallel group from the run's topology."""

from lightspeed.parallel.experts import MoE

__all__ = ["MoE"]
