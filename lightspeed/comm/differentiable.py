"""Collectives that autograd differentiates: the sequence <-> head all-to-all of Ulysses attention, the
expert all-to-all of a mixture-of-experts layer, an all-gather whose backward routes each rank's
share of the gradient home, and the split / gather of a tensor-parallel group's duplicate tokens.

Owns: `seq_all_to_all` (DeepSpeed's `_SeqAllToAll`), `expert_all_to_all` (DeepSpeed's MoE `_AllToAll`,
with a gradient scale), `ragged_all_to_all` (rows in blocks of per-rank sizes, for token dispatch
without capacity), `drop_tokens` and `gather_tokens` (DeepSpeed's MoE `_DropTokens` / `_GatherTokens`,
with a gradient scale and optional uneven parts), `all_gather_autograd`, and `all_gather_tensors` (a
no-grad gather of tensors whose shapes may differ by rank, for data loading). Must not: know about
models, heads or batches beyond the dimensions it is told.

Note: the all-to-all and its gradient
    `seq_all_to_all(x, group, scatter_dim, gather_dim)` splits `x` into W equal pieces along
    `scatter_dim`, sends piece j to rank j, and concatenates what it receives along `gather_dim` in rank
    order. As a map from the W ranks' inputs to their outputs it is a permutation of elements, so its
    adjoint is the inverse permutation: the same all-to-all with the two dimensions swapped. That is
    the whole backward; nothing is summed.

Note: [dropping and gathering tokens] `drop_tokens(x, group, dim)` keeps this rank's part of `x`
along `dim` (part r of W: equal parts, or `sizes[r]` elements at offset sum(sizes[:r])), and
`gather_tokens(x, group, dim)` concatenates every rank's part along `dim` in rank order. Each is the
other's adjoint when the W ranks hold the same `x` (the tensor-parallel ranks' duplicate tokens,
DeepSpeed's use): the gradient of a dropped part is gathered back, the gradient of a gathered tensor
is cut to this rank's part; nothing is summed. `grad_scale` multiplies the gradient each one returns
(the MoE layers use it so that the expert gradients between the two are W times their share: see
parallel/experts/layer.py's Note on the expert gradient's average).
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


def _parts(size: int, world: int, sizes: list[int] | None, what: str) -> list[int]:
    if sizes is None:
        if size % world:
            raise ValueError(f"{what}: a dimension of {size} elements does not divide into {world} equal parts (the "
                             "tensor-parallel size)")
        return [size // world] * world
    if len(sizes) != world or sum(sizes) != size or min(sizes) < 0:
        raise ValueError(f"{what}: parts {sizes} do not split a dimension of {size} elements over {world} ranks")
    return [int(n) for n in sizes]


def _drop(x: torch.Tensor, group: Any, dim: int, sizes: list[int] | None) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    parts = _parts(x.shape[dim], world, sizes, "drop_tokens")
    rank = dist.get_rank(group)
    return x.narrow(dim, sum(parts[:rank]), parts[rank])


def _gather(x: torch.Tensor, group: Any, dim: int, sizes: list[int] | None) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    parts = [x.shape[dim]] * world if sizes is None else [int(n) for n in sizes]
    if len(parts) != world or parts[dist.get_rank(group)] != x.shape[dim]:
        raise ValueError(f"gather_tokens: parts {parts} over {world} ranks, this rank holds {x.shape[dim]}")
    longest = max(parts)
    if x.shape[dim] < longest:  # equal-sized messages: pad this rank's part to the longest
        pad = list(x.shape)
        pad[dim] = longest - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    out = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(out, x.contiguous(), group=group)
    return torch.cat([o.narrow(dim, 0, n) for o, n in zip(out, parts)], dim=dim)


class _DropTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int, sizes, grad_scale: float) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.sizes, ctx.grad_scale = group, dim, sizes, grad_scale
        return _drop(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = _gather(grad.contiguous(), ctx.group, ctx.dim, ctx.sizes)
        return (grad if ctx.grad_scale == 1.0 else grad * ctx.grad_scale), None, None, None, None


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, dim: int, sizes, grad_scale: float) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.sizes, ctx.grad_scale = group, dim, sizes, grad_scale
        return _gather(x, group, dim, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = _drop(grad, ctx.group, ctx.dim, ctx.sizes)
        return (grad if ctx.grad_scale == 1.0 else grad * ctx.grad_scale).contiguous(), None, None, None, None


def drop_tokens(x: torch.Tensor, group: Any, dim: int, sizes: list[int] | None = None,
                grad_scale: float = 1.0) -> torch.Tensor:
    """This rank's part of `x` along `dim` (the Note on dropping and gathering tokens): equal parts over
    `group`, or `sizes[r]` elements for rank r. Differentiable: the gradient is gathered over `group`
    (every rank's part), times `grad_scale`."""
    return _DropTokens.apply(x, group, dim, None if sizes is None else [int(n) for n in sizes], grad_scale)


def gather_tokens(x: torch.Tensor, group: Any, dim: int, sizes: list[int] | None = None,
                  grad_scale: float = 1.0) -> torch.Tensor:
    """Every rank's `x` of `group` concatenated along `dim` in rank order (rank r's part has `sizes[r]`
    elements when given, else every part has this rank's). Differentiable: the gradient is this rank's
    part of the incoming one, times `grad_scale`."""
    return _GatherTokens.apply(x, group, dim, None if sizes is None else [int(n) for n in sizes], grad_scale)


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
