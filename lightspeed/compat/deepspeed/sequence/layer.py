"""`deepspeed.sequence.layer`: `DistributedAttention` and its all-to-all, from lightspeed.sequence."""

from lightspeed.comm.differentiable import seq_all_to_all
from lightspeed.sequence import DistributedAttention

__all__ = ["DistributedAttention", "seq_all_to_all"]
