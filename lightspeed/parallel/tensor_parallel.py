"""Tensor parallelism for training (DeepSpeed's AutoTP training): the planned linear layers of a model
become Megatron-style column- and row-parallel layers holding this rank's slice, with gradients.

Owns: the two layer classes, the layout of each split parameter against the whole one (`TPLayout`:
slicing a whole tensor, gathering the slices back, for consolidated saves and checkpoints), the
transform `apply_tensor_parallel`, and `tp_model_init` (DeepSpeed's name). Must not: issue collectives
except through comm/ (the layers hand their `Communicator` to comm/tp_autograd.py), or change modules
the plan does not name (embeddings, norms and the output head stay whole on every rank).

Note: [training layers] A column-parallel layer keeps rows of W [N, K] (and of its bias): its input is
the whole activation, identical on every tp rank, and its output this rank's features; backward sums
the input gradient over the group (`copy_to_group`). A row-parallel layer keeps columns of W, reads this
rank's features and sums its partial output over the group (`reduce_from_group`); its bias is whole on
every rank and added once, after the sum, so its gradient is the same on every rank (a replicated
parameter). Fused layers (GPT-2's c_attn, Phi-3's qkv_proj) keep their rows of each part, as the plan's
`Slice` says; parts kept whole on every rank (multi-query k/v heads) and a plan's MoE experts are not
split for training (refused; parallel/experts/ slices experts over tp itself, with these layers). The output head stays whole (DeepSpeed's training AutoTP likewise keeps it
replicated unless asked): splitting it would need a gather of the logits before the loss.

Note: [layers built under zero.Init] A layer of a model built under zero.Init (from_pretrained at
ZeRO-3) holds empty placeholders (their `ds_shape` gives the layouts). Its split layer is built from
this rank's slices alone: `TPLayout.boxes` names them as boxes of the whole tensors, and the reader
`initialize()` gives (zero/stage3/init_rows.py's `replace_init_module`) hands every rank exactly those
from the ranks holding them, by one all-to-all per layer (no rank gathers the whole layer), then
partitions the split layer's parameters by zero.Init again over the ranks holding the same slices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightspeed._utils.logging import get_logger
from lightspeed.comm.collectives import Communicator
from lightspeed.comm.tp_autograd import copy_to_group, reduce_from_group
from lightspeed.parallel.module_kinds import is_conv1d, is_linear, logical_shape
from lightspeed.parallel.tp_plan import EXPERTS, ROWWISE, Slice, build_plan, is_colwise, part_rows, \
    per_rank_attributes, whole_parts

logger = get_logger(__name__)


@dataclass(frozen=True)
class TPLayout:
    """One split parameter against the whole one: the plan's `style`, `role` ("weight" or "bias"), the
    whole parameter's `full_shape` as the original module held it (transformers' Conv1D: [in, out],
    `transposed`), and `tp_size`. `sharded` is False for a row-parallel bias (whole on every rank)."""

    style: str
    role: str
    full_shape: tuple[int, ...]
    transposed: bool
    tp_size: int

    @property
    def sharded(self) -> bool:
        return not (self.role == "bias" and self.style == ROWWISE)

    def _rows(self) -> int:
        if self.role == "bias":
            return self.full_shape[0]
        return self.full_shape[1] if self.transposed else self.full_shape[0]

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's slice of the whole tensor `full` (`full_shape`), in the split layer's layout
        ([N/tp, K] or [N, K/tp] weights, 1-D biases)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"tensor parallelism: expected a whole tensor of shape {self.full_shape}, got "
                             f"{tuple(full.shape)}")
        if not self.sharded:
            return full.clone()
        part = Slice(self.style, rank, self.tp_size)
        if self.role == "bias":
            return part.bias(full).clone()
        return part.weight(full.t() if self.transposed else full).contiguous()

    def boxes(self, rank: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """This rank's slice as boxes of the whole tensor ([start, stop) per dim of `full_shape`, joined
        along the one dim where they differ): `shard` is their join, transposed back for a `transposed`
        weight (the Note on layers built under zero.Init)."""
        if not self.sharded:
            return (tuple((0, n) for n in self.full_shape),)
        part = Slice(self.style, rank, self.tp_size)
        if self.role == "bias":
            return tuple((rows.indices(self.full_shape[0])[:2],) for rows, _ in part.indices((self.full_shape[0], 1)))
        shape = self.full_shape[::-1] if self.transposed else self.full_shape
        out = []
        for index in part.indices(shape):
            box = tuple(i.indices(n)[:2] for i, n in zip(index, shape))
            out.append(box[::-1] if self.transposed else box)
        return tuple(out)

    def shard_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of `shard(full, rank)`, worked out on the meta device (no data)."""
        return tuple(self.shard(torch.empty(self.full_shape, device="meta"), rank).shape)

    def gather(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The whole tensor (`full_shape`, the original module's layout) from every tp rank's slice, in
        tp rank order."""
        if len(shards) != self.tp_size:
            raise ValueError(f"tensor parallelism: {len(shards)} slices for tp_size {self.tp_size}")
        if not self.sharded:
            return shards[0].clone()
        if is_colwise(self.style):
            pieces, offsets = [], [0] * len(shards)
            for rows, whole in zip(part_rows(self.style, self._rows()), whole_parts(self.style)):
                n = rows if whole else rows // self.tp_size
                chunks = [s.narrow(0, off, n) for s, off in zip(shards, offsets)]
                offsets = [off + n for off in offsets]
                pieces.extend(chunks[:1] if whole else chunks)
            full = torch.cat(pieces, dim=0)
        else:
            full = torch.cat(shards, dim=1)
        return (full.t() if self.transposed else full).contiguous()


class _ParallelLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Communicator, layouts: dict[str, TPLayout],
                 requires_grad: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=requires_grad)
        self.comm = comm
        self.layouts = layouts  # {"weight": TPLayout, "bias": TPLayout}

    @property
    def tp_size(self) -> int:
        return self.comm.world_size

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp_size={self.tp_size}")


class ColumnParallelLinear(_ParallelLinear):
    """y[..., N/tp] = x[..., K] @ W_slice.T + b_slice; the gradient of x is summed over the group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_group(x, self.comm), self.weight, self.bias)


class RowParallelLinear(_ParallelLinear):
    """y[..., N] = sum over the group of x[..., K/tp] @ W_slice.T, plus the whole bias once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_group(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias


# (module, {parameter name: this rank's boxes of it}, build) -> build(this rank's boxes of each), its
# parameters partitioned by zero.Init again: a layer partitioned by zero.Init (the Note on layers built
# under zero.Init; lightspeed.zero.stage3.init_rows.replace_init_module, given by initialize()); collective
PartitionedLayer = Callable[[nn.Module, dict[str, tuple[tuple[tuple[int, int], ...], ...]],
                             Callable[[dict[str, torch.Tensor]], nn.Module]], nn.Module]


def split_linear(module: nn.Module, style: str, comm: Communicator,
                 partitioned: PartitionedLayer | None = None) -> _ParallelLinear:
    """The parallel layer holding this rank's slice of `module` (an nn.Linear or a Conv1D; same device,
    dtype and requires_grad); `partitioned` reads the slices of a layer partitioned by zero.Init."""
    transposed = is_conv1d(module)
    layouts = {"weight": TPLayout(style, "weight", logical_shape(module.weight), transposed, comm.world_size)}
    if module.bias is not None:
        layouts["bias"] = TPLayout(style, "bias", logical_shape(module.bias), transposed, comm.world_size)
    cls = ColumnParallelLinear if is_colwise(style) else RowParallelLinear
    requires_grad = module.weight.requires_grad
    if getattr(module.weight, "ds_shape", None) is not None:  # partitioned by zero.Init: receive the slices
        if partitioned is None:
            raise NotImplementedError(f"tensor_parallel: {type(module).__name__} is partitioned by zero.Init and no "
                                      "reader of its slices was given; go through initialize()")

        def build(parts: dict[str, torch.Tensor]) -> _ParallelLinear:
            w = parts["weight"].t().contiguous() if transposed else parts["weight"]
            return cls(w, parts.get("bias"), comm, layouts, requires_grad=requires_grad)

        return partitioned(module, {role: layout.boxes(comm.rank) for role, layout in layouts.items()}, build)
    weight = module.weight.detach()
    bias = None if module.bias is None else module.bias.detach()
    w = layouts["weight"].shard(weight, comm.rank)
    b = None if bias is None else layouts["bias"].shard(bias, comm.rank)
    return cls(w, b, comm, layouts, requires_grad=requires_grad)


def tp_layouts(model: nn.Module) -> dict[str, TPLayout]:
    """{parameter name in `model`: its TPLayout} of every split parameter."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, _ParallelLinear):
            for role, layout in module.layouts.items():
                out[f"{name}.{role}" if name else role] = layout
    return out


def split_tp_size(model: nn.Module) -> int:
    """The tp size the model's split layers were made for (1 when none is split)."""
    sizes = {m.tp_size for m in model.modules() if isinstance(m, _ParallelLinear)}
    if len(sizes) > 1:
        raise ValueError(f"tensor parallelism: the model's layers are split for different tp sizes {sorted(sizes)}")
    return sizes.pop() if sizes else 1


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def apply_tensor_parallel(model: nn.Module, comm: Communicator, plan: dict[str, str] | None = None,
                          partitioned: PartitionedLayer | None = None) -> nn.Module:
    """Split `model` in place over `comm`'s group (the tensor-parallel group): every layer of `plan`
    ({module name: style}; default: the model's own, `tp_plan.build_plan`) becomes a column- or
    row-parallel layer, and attention modules keeping head counts get this rank's. Returns `model`."""
    tp_size = comm.world_size
    if plan is None:
        plan = build_plan(model, tp_size, split_head=False)
    for name, style in plan.items():
        if style == EXPERTS:
            raise NotImplementedError(f"tensor_parallel: training with the MoE experts {name} split is not "
                                      "implemented")
        if is_colwise(style) and any(whole_parts(style)):
            raise NotImplementedError(f"tensor_parallel: training {name}, a fused layer with parts kept whole on "
                                      "every rank (multi-query attention), is not implemented")
        if not (is_colwise(style) or style == ROWWISE):
            raise NotImplementedError(f"tensor_parallel: style {style!r} of {name} is not implemented for training")
        module = model.get_submodule(name)
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            kind = type(module).__name__ if is_linear(module) else f"not a linear layer ({type(module).__name__})"
            raise TypeError(f"tensor_parallel: {name} is {kind}; only nn.Linear and transformers' Conv1D split")
    if tp_size == 1:
        return model
    for name, style in plan.items():
        _replace(model, name, split_linear(model.get_submodule(name), style, comm, partitioned))
    changed = per_rank_attributes(model, plan, tp_size, comm.rank)
    logger.info("tensor parallel: %d layers split over %d ranks (%d row-parallel)%s", len(plan), tp_size,
                sum(style == ROWWISE for style in plan.values()),
                f"; per-rank attributes: {', '.join(changed)}" if changed else "")
    return model


def gather_tp_state(state: dict[str, torch.Tensor | None], layouts: dict[str, TPLayout],
                    comm: Communicator, keep: bool = True) -> dict[str, torch.Tensor | None]:
    """`state` ({name: this rank's tensor}) with every split entry of `layouts` replaced by the whole tensor
    gathered from the tp group (`comm`), in the original module's layout; other entries as they are.
    Collective over the tp group: every rank passes the same names in the same order. With `keep`
    False this rank only contributes its slices (it gets `state` back, holding no whole tensor: a save
    that one rank writes needs the whole model on that rank alone)."""
    out = dict(state)
    if comm.world_size == 1:
        return out
    for name, tensor in state.items():
        layout = layouts.get(name)
        if layout is None or tensor is None or not layout.sharded:
            continue
        local = tensor.detach().contiguous()
        gathered = torch.empty((comm.world_size, *local.shape), dtype=local.dtype, device=local.device)
        comm.all_gather(gathered.view(-1), local.view(-1))
        if keep:
            out[name] = layout.gather(list(gathered.unbind(0)))
    return out
