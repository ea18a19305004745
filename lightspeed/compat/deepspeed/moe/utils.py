"""`deepspeed.moe.utils`: DeepSpeed's tests for expert parameters and its optimizer-group helpers.

An expert parameter is, as in DeepSpeed, one carrying `allreduce=False` (the MoE layer marks its
experts' parameters so, with a `group_name` naming their expert group, `ep_size_<N>`). lightspeed's
strategies reduce each expert gradient over its group from the parameter's placement, not from the
optimizer's groups, so the split is for DeepSpeed's optimizer-group layout (and per-group settings)
only: a model trains the same with or without it.
"""

from __future__ import annotations

import torch

from lightspeed.parallel.experts import MoE


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's test: the parameter has an `allreduce` attribute and it is false."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(model: torch.nn.Module) -> tuple[bool, int]:
    """(whether `model` holds a DeepSpeed MoE layer, its number of experts); (False, 0) without one."""
    for module in model.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    """(the shared parameters, the expert parameters), in the order given."""
    params = list(params)
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_grads_into_shared_and_expert_params(group) -> tuple[list, list]:
    """(the shared parameters' gradients, the expert parameters'), each cast to its parameter's dtype;
    parameters without a gradient are left out."""
    shared, expert = [], []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def is_moe_param_group(param_group: dict) -> bool:
    return param_group.get("moe", False)


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971) -> list[dict]:
    """DeepSpeed's split of optimizer groups: each group keeps its dense parameters, and for every expert
    group name (`param.group_name`) a copy of each group's settings with `name` that group name and
    `moe` True takes that group's expert parameters, appended after the given groups in chunks of at
    most `max_group_size` elements (None: one chunk). A dict or tuple is accepted, as DeepSpeed does;
    the groups must have a `name` when they hold expert parameters."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        group["params"] = list(group["params"])  # a generator would be spent by the scans below
    expert_names = sorted({p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)})
    appended = []
    for group in param_groups:
        experts = [p for p in group["params"] if is_moe_param(p)]
        if experts and "name" not in group:
            raise KeyError("split_params_into_different_moe_groups_for_optimizer: a parameter group holding expert "
                           "parameters needs a 'name'")
        for name in expert_names if experts or "name" in group else ():
            mine = [p for p in experts if p.group_name == name]
            for chunk in _chunks(mine, max_group_size):
                appended.append({**group, "name": name, "moe": True, "params": chunk})
        group["params"] = [p for p in group["params"] if not is_moe_param(p)]
    return param_groups + appended


def _chunks(params: list, max_group_size) -> list[list]:
    """`params` in order, cut into runs of at most `max_group_size` elements (a larger parameter alone)."""
    if max_group_size is None:  # DeepSpeed then keeps even an empty group
        return [params]
    out, current, size = [], [], 0
    for p in params:
        n = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
        if current and size + n > max_group_size:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += n
    return out + [current] if current else out


def configure_moe_param_groups(model_parameters: list) -> list:
    """DeepSpeed's preparation of `model_parameters` (parameters or groups) for an MoE model: the
    groups, split as `split_params_into_different_moe_groups_for_optimizer` does."""
    if not isinstance(model_parameters, list):
        raise TypeError("configure_moe_param_groups: model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an iterable of Tensors "
                            f"or dicts, but got {type(p)}")
    if model_parameters and isinstance(model_parameters[0], torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                     "name": "dense-params"})
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)


__all__ = ["configure_moe_param_groups", "has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]
