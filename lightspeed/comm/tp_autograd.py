"""The two collectives of Megatron-style tensor-parallel layers as autograd functions over one group.

`copy_to_group(x, comm)`: identity forward, all-reduce (sum) of the input's gradient backward; a
column-parallel layer applies it to its (replicated) input, so the gradient reaching the layers before
it is the sum of every rank's slice's contribution. `reduce_from_group(y, comm)`: all-reduce (sum)
forward, identity backward; a row-parallel layer applies it to its partial output. Owns only these
two functions; must not hold groups (the layer hands its `Communicator`).
"""

from __future__ import annotations

import torch

from lightspeed.comm.collectives import Communicator


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        out = x.contiguous().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """x unchanged; its gradient summed over `comm`'s group (see the module docstring)."""
    return x if comm.world_size == 1 else _CopyToGroup.apply(x, comm)


def reduce_from_group(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """x summed over `comm`'s group; its gradient passed through (see the module docstring)."""
    return x if comm.world_size == 1 else _ReduceFromGroup.apply(x, comm)
