"""`deepspeed.moe.utils`: DeepSpeed's tests for expert parameters and its optimizer-group helpers.

An expert parameter is, as in DeepSpeed, one carrying `allreduce=False` (DeepSpeed's MoE layer marks
its experts' parameters so, with a `group_name` naming their expert-data-parallel group). lightspeed
builds no such layer, so these answer "no experts" for every model it can train; a parameter marked
by hand makes the group split raise NotImplementedError, since the engine would reduce it over the
whole data-parallel group instead of its expert group.
"""

from __future__ import annotations

import torch

from lightspeed.compat.deepspeed.moe.layer import MoE

_EXPERTS = "expert parallelism (parameters marked allreduce=False by a mixture-of-experts layer)"


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
    """DeepSpeed's split of optimizer groups into dense and per-expert-group ones. Without expert
    parameters the groups come back unchanged, as a list (a dict or tuple is accepted, as DeepSpeed
    does); with any, NotImplementedError."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        group["params"] = list(group["params"])  # a generator would be spent by the scan below
        if any(is_moe_param(p) for p in group["params"]):
            raise NotImplementedError(f"deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer: "
                                      f"{_EXPERTS} is not implemented in lightspeed yet")
    return param_groups


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
