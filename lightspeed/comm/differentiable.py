"""Collectives that autograd differentiates: the sequence <-> head all-to-all of Ulysses attention, the
expert all-to-all of a mixture-of-experts layer, and an all-gather whose backward routes each rank's
share of the gradient home.

Owns: `seq_all_to_all` (DeepSpeed's `_SeqAllToAll`), `expert_all_to_all` (DeepSpeed's MoE `_AllToAll`,
with a gradient scale), `ragged_all_to_all` (rows in blocks of per-rank sizes, for token dispatch
without capacity), `all_gather_autograd`, and `all_gather_tensors` (a
no-grad gather of tensors whose shapes may differ by rank, for data loading). Must not: know about
models, heads or batches beyond the dimensions it is told.

Note: the all-to-all and its gradient
    `seq_all_to_all(x, group, scatter_dim, gather_dim)` splits `x` into W equal pieces along
    `scatter_dim`, sends piece j to rank j, and concatenates what it receives along `gather_dim` in rank
    order. As a map from the W ranks' inputs to their outputs it is a permutation of elements, so its
    adjoint is the inverse permutation: the same all-to-all with the two dimensions swapped. That is
    the whole backward; nothing is summed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _world(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    size = x.shape[scatter_dim]
    if size % world != 0:
        raise ValueError(f"sequence all-to-all: dimension {scatter_dim} of a {tuple(x.shape)} tensor ({size}) is "
                         f"not divisible by the sequence-parallel size {world}")
    # [.., W*n, ..] -> [W, .., n, ..]: piece j (for rank j) becomes the leading, contiguous block
    send = x.unflatten(scatter_dim, (world, size // world)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] came from rank j: its piece of the gathered dimension goes j-th along gather_dim
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _SeqAllToAll.apply(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all over `group` (None: the default group): `x` split along `scatter_dim`, the pieces from
    every rank joined along `gather_dim`; differentiable. E.g. [b, s/W, h, d] with scatter 2, gather 1 ->
    [b, s, h/W, d]."""
    return _SeqAllToAll.apply(x, group, scatter_dim, gather_dim)


class _ExpertAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, grad_scale: float) -> torch.Tensor:
        ctx.group, ctx.grad_scale = group, grad_scale
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = _ExpertAllToAll.apply(grad.contiguous(), ctx.group, 1.0)
        return (grad if ctx.grad_scale == 1.0 else grad * ctx.grad_scale), None, None


def expert_all_to_all(x: torch.Tensor, group: Any, grad_scale: float = 1.0) -> torch.Tensor:
    """All-to-all over `group` along dim 0 (W equal blocks: block j to rank j, received blocks in rank
    order), differentiable: the gradient is the inverse all-to-all (the same one), times `grad_scale`."""
    return _ExpertAllToAll.apply(x, group, grad_scale)


class _RaggedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, send: list[int], recv: list[int], grad_scale: float):
        ctx.group, ctx.send, ctx.recv, ctx.grad_scale = group, send, recv, grad_scale
        x = x.contiguous()
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # the adjoint of a permutation of rows is its inverse: the same exchange with the sizes swapped
        grad = _RaggedAllToAll.apply(grad.contiguous(), ctx.group, ctx.recv, ctx.send, 1.0)
        return (grad if ctx.grad_scale == 1.0 else grad * ctx.grad_scale), None, None, None, None


def ragged_all_to_all(x: torch.Tensor, group: Any, send_sizes: list[int], recv_sizes: list[int],
                      grad_scale: float = 1.0) -> torch.Tensor:
    """All-to-all over `group` along dim 0 with per-rank block sizes: rows [sum(send_sizes[:j]),
    sum(send_sizes[:j+1])) go to rank j; the result holds `recv_sizes[j]` rows from each rank j, in rank
    order. Differentiable: the gradient goes back by the same exchange with the sizes swapped, times
    `grad_scale`. The sizes must agree across ranks (rank i's send_sizes[j] is rank j's recv_sizes[i])."""
    if len(send_sizes) != _world(group) or len(recv_sizes) != len(send_sizes) or sum(send_sizes) != x.shape[0]:
        raise ValueError(f"ragged all-to-all: {len(send_sizes)} send sizes summing to {sum(send_sizes)} and "
                         f"{len(recv_sizes)} receive sizes for a group of {_world(group)} ranks and "
                         f"{x.shape[0]} rows")
    return _RaggedAllToAll.apply(x, group, [int(n) for n in send_sizes], [int(n) for n in recv_sizes], grad_scale)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        world = _world(group)
        ctx.rank = dist.get_rank(group) if world > 1 else 0
        if world == 1:
            return x.unsqueeze(0).clone()
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every rank's output depends on this rank's input: its gradient is the sum over ranks of their
        # gradients for slot `rank` (an all-reduce then a slice: gloo has no reduce-scatter of lists)
        grad = grad.contiguous()
        if _world(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def all_gather_autograd(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Stack of every rank's `x` (shape [W, *x.shape]), differentiable with respect to this rank's `x`."""
    return _AllGather.apply(x, group)


@torch.no_grad()
def all_gather_tensors(x: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's `x`, in rank order, where the shapes may differ by rank (same dtype and rank count)."""
    world = _world(group)
    if world == 1:
        return [x]
    if x.dtype == torch.bool:  # travels as bytes: not every backend reduces or gathers bool
        return [t.bool() for t in all_gather_tensors(x.to(torch.uint8), group)]
    shapes: list[Any] = [None] * world
    dist.all_gather_object(shapes, tuple(x.shape), group=group)
    # equal-sized messages (some backends need them): each rank's elements, flat, padded to the longest
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    longest = max(numels)
    flat = torch.zeros(longest, dtype=x.dtype, device=x.device)
    flat[:x.numel()] = x.reshape(-1)
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat, group=group)
    return [o[:n].reshape(shape) for o, n, shape in zip(out, numels, shapes)]


def all_gather_objects(obj: Any, group: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order."""
    world = _world(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out
