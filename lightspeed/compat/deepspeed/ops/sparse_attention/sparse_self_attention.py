"""`deepspeed.ops.sparse_attention.sparse_self_attention`: `SparseSelfAttention` with DeepSpeed's layout
broadcast: on first use the master layout is overwritten by global rank 0's when a process group is up
(lightspeed.ops.sparse_attention.sparse_self_attention's Note: [layout on every rank])."""

from __future__ import annotations

import torch

from lightspeed import comm
from lightspeed.ops.sparse_attention import sparse_self_attention as _ops


def broadcast_layout_from_rank0(layout: torch.Tensor) -> None:
    """Overwrite `layout` with global rank 0's (nothing to do without a process group). NCCL needs a
    CUDA tensor: a CPU layout travels through a CUDA copy there."""
    if not comm.is_initialized():
        return
    buffer = layout
    if comm.get_backend() == "nccl" and not layout.is_cuda:
        buffer = layout.to(torch.device("cuda", torch.cuda.current_device()))
    comm.broadcast(buffer, src=0)
    if buffer is not layout:
        layout.copy_(buffer)


class SparseSelfAttention(_ops.SparseSelfAttention):
    __doc__ = _ops.SparseSelfAttention.__doc__
    layout_broadcast = staticmethod(broadcast_layout_from_rank0)


__all__ = ["SparseSelfAttention", "broadcast_layout_from_rank0"]
