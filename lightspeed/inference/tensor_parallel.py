"""Tensor parallelism for `init_inference` (DeepSpeed's AutoTP, without kernel injection): each rank of the
tensor-parallel group keeps a slice of every planned linear layer, so a model too large for one GPU
runs on several and each decode step reads 1/tp of the weights per GPU.

Owns: init_inference's `tensor_parallel` argument, the refusal of layers quantized already, the frozen
slices it builds and the hooks that sum a row-parallel layer's output over the group. The plan itself
(which layers are split and how; the Notes on fused layers, experts and the output head) lives in
lightspeed/parallel/tp_plan.py, shared with training. Must not: issue collectives except through comm/.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lightspeed.inference.experts import QuantizedExperts
from lightspeed.inference.quantized_linear import QuantizedLinear, is_conv1d, is_linear, linear_from_float
from lightspeed.parallel import tp_plan
from lightspeed.parallel.tp_plan import (  # noqa: F401 (the plan's names, as inference code has always read them)
    BUILTIN_PLANS,
    COLWISE,
    COLWISE_QKV,
    EXPERTS,
    HEAD,
    ROW_STYLES,
    ROWWISE,
    Slice,
    colwise_parts,
    expert_indices,
    is_colwise,
    part_rows,
    per_rank_attributes,
    whole_parts,
)


def _refuse_quantized(name: str, module: nn.Module, style: str) -> None:
    if isinstance(module, QuantizedExperts):
        raise NotImplementedError(f"init_inference: tensor parallelism of the experts {name}: quantized already")
    if isinstance(module, QuantizedLinear):
        raise ValueError(f"init_inference: {name} is quantized already; a packed layer cannot be split for tensor "
                         "parallelism: pass the float model and quant= (slices are quantized after the split)")


def build_plan(model: nn.Module, tp_size: int, injection_policy=None) -> dict[str, str]:
    """The shared plan (`tp_plan.build_plan`), with layers quantized already refused."""
    return tp_plan.build_plan(model, tp_size, injection_policy, check=_refuse_quantized)


def tp_settings(value) -> tuple[int, object]:
    """(tp_size, tp_group) from DeepSpeed's `tensor_parallel` (a dict {"tp_size", "tp_group", "enabled"},
    an object with those attributes, or an int)."""
    if value is None:
        return 1, None
    if isinstance(value, Mapping):
        if not value.get("enabled", True):
            return 1, None
        unknown = set(value) - {"enabled", "tp_size", "tp_group", "mpu"}
        if unknown:
            raise ValueError(f"init_inference: unknown tensor_parallel key {sorted(unknown)[0]!r} "
                             "(known: enabled, tp_size, tp_group, mpu)")
        if value.get("mpu") is not None:
            raise NotImplementedError("init_inference: tensor_parallel['mpu'] is not implemented; pass tp_group")
        return int(value.get("tp_size", 1) or 1), value.get("tp_group")
    if isinstance(value, int):
        return value, None
    return int(getattr(value, "tp_size", 1) or 1), getattr(value, "tp_group", None)




def shard_experts(module: nn.Module, rank: int, tp_size: int) -> nn.Module:
    """The experts module with its 3-D parameters cut to this rank's part of every expert (in place)."""
    for param, kind in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
        weight = getattr(module, param).detach()
        pieces = [weight[(slice(None), *index)] for index in expert_indices(kind, *weight.shape[1:], rank, tp_size)]
        setattr(module, param, nn.Parameter(torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0].contiguous(),
                                            requires_grad=False))
    return module


def shard_linear(module: nn.Module, style: str, rank: int, tp_size: int) -> nn.Linear:
    """A new nn.Linear holding this rank's slice of `module` (an nn.Linear or a Conv1D; same device and
    dtype)."""
    part = Slice(style, rank, tp_size)
    weight = module.weight.detach()
    return linear_from_float(part.weight(weight.t() if is_conv1d(module) else weight),
                             part.bias(None if module.bias is None else module.bias.detach()))




class _SliceInput:
    """Forward pre-hook of the split output head: this rank's slice of the (whole) last input dim."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def __call__(self, module, args):
        x = args[0]
        k = x.shape[-1] // self.size
        return (x[..., self.rank * k:(self.rank + 1) * k], *args[1:])


class _AllReduce:
    """Forward hook of a row-parallel layer: its output summed over the tensor-parallel group, in place."""

    def __init__(self, comm):  # a lightspeed.comm Communicator on the tensor-parallel group
        self.comm = comm

    def __call__(self, module, inputs, output):
        self.comm.all_reduce(output)
        return output


def attach_all_reduce(model: nn.Module, plan: Mapping[str, str], comm) -> None:
    """Hook every row-parallel layer (after any quantization swap: the hooks go on the final modules)."""
    for name, style in plan.items():
        if style == EXPERTS:  # each rank's experts give partial sums of the block's output
            model.get_submodule(name).register_forward_hook(_AllReduce(comm))
        if style in ROW_STYLES:
            module = model.get_submodule(name)
            if not is_linear(module):
                raise TypeError(f"{name}: expected a linear layer, found {type(module).__name__}")
            if style == HEAD:
                module.register_forward_pre_hook(_SliceInput(comm.rank, comm.world_size))
            module.register_forward_hook(_AllReduce(comm))
