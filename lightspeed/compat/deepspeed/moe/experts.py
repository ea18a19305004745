"""`deepspeed.moe.experts`: DeepSpeed's `Experts` (this rank's deep copies of the expert module, their
parameters marked `allreduce=False` with the expert group's name)."""

from lightspeed.parallel.experts import Experts

__all__ = ["Experts"]
