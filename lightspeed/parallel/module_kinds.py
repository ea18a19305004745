"""Recognising the modules a tensor-parallel plan can split, without importing transformers: linear
layers (nn.Linear, transformers' Conv1D with its [in, out] weight, and any layer declaring integer
`in_features` / `out_features`, as inference's packed layers do) and transformers' MoE experts modules.
Must not: change a module."""

from __future__ import annotations

import inspect

import torch
from torch import nn

_FORWARD_ARGS = ("hidden_states", "top_k_index", "top_k_weights")
# transformers' `use_experts_implementation` flags, and the values an eager loop over experts computes
EXPERT_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                "has_post_expert_norm": False}


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer with weight [in, out]; recognised without importing
    transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(getattr(module, "weight", None),
                                                                                       torch.Tensor)


def is_linear(module: nn.Module | None) -> bool:
    if module is None:
        return False
    if isinstance(module, nn.Linear) or is_conv1d(module):
        return True
    dims = (getattr(module, "in_features", None), getattr(module, "out_features", None))
    return all(isinstance(d, int) and not isinstance(d, bool) for d in dims)


def logical_shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape; for one partitioned by ZeRO-3 (an empty placeholder), DeepSpeed's `ds_shape`."""
    shape = getattr(p, "ds_shape", None)
    return tuple(shape) if shape is not None else tuple(p.shape)


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of a linear layer (`is_linear`)."""
    if is_conv1d(module):
        shape = logical_shape(module.weight)
        return shape[1], shape[0]
    if isinstance(module, nn.Linear):
        shape = logical_shape(module.weight)
        return shape[0], shape[1]
    return module.out_features, module.in_features


def experts_layout(module: nn.Module) -> tuple[int, int, int] | str | None:
    """(experts, hidden, intermediate) of a transformers experts module computed by an eager loop over
    its 3-D `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], a reason string for an experts module
    of another kind, None for any other module."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and len(logical_shape(gate_up)) == 3):
        return None
    for flag, want in EXPERT_FLAGS.items():
        if getattr(module, flag, want) != want:
            return f"{flag}={getattr(module, flag)!r} (the eager loop here has {flag}={want})"
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        params = []
    if tuple(params[:3]) != _FORWARD_ARGS or not callable(getattr(module, "act_fn", None)):
        return "its forward is not (hidden_states, top_k_index, top_k_weights) with an act_fn"
    (experts, two_inter, hidden), down_shape = logical_shape(gate_up), logical_shape(down)
    if len(down_shape) != 3 or two_inter % 2 or down_shape != (experts, hidden, two_inter // 2):
        return f"gate_up_proj {logical_shape(gate_up)} and down_proj {down_shape} do not match"
    return experts, hidden, two_inter // 2
