"""`model_parameters` across a model transform that replaces parameters (tensor parallelism's split).

Owns: recording a caller's `model_parameters` (any iterable of the model's parameters, or of param
group dicts with "params", as torch optimizers take them; a generator such as `model.parameters()`
included) by the parameters' names in the model, and rebuilding the same structure from the
transformed model's parameters of those names. DeepSpeed consumes `model_parameters` only after its
own split, so a script passing `model.parameters()` to `initialize()` gets the split parameters.
Must not: accept a parameter that is not the model's (it could not follow the split), or change
anything in a group but its "params".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightspeed.config.errors import ConfigError

_KEY = "tensor_parallel.autotp_size"


def _names(model: torch.nn.Module, params, where: str) -> list[str]:
    first_name = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), name)
    if isinstance(params, torch.Tensor):
        params = [params]
    out = []
    for i, p in enumerate(params):
        name = first_name.get(id(p))
        if name is None:
            raise ConfigError(f"{_KEY}: initialize() splits the model, and {where}[{i}] (shape {tuple(p.shape)}) "
                              "is not one of the model's parameters, so it cannot follow the split; pass the "
                              "model's own parameters, or split the model first with tp_model_init()")
        out.append(name)
    return out


def params_by_name(model: torch.nn.Module, model_parameters: Iterable) -> list:
    """`model_parameters` (consumed once) with each parameter replaced by its name in `model`."""
    items = list(model_parameters)
    if any(isinstance(item, dict) for item in items) and not all(isinstance(item, dict) for item in items):
        raise TypeError("initialize(): model_parameters mixes param group dicts and parameters")
    if items and isinstance(items[0], dict):
        return [{**group, "params": _names(model, group["params"], f"model_parameters[{i}]['params']")}
                for i, group in enumerate(items)]
    return _names(model, items, "model_parameters")


def params_from_names(model: torch.nn.Module, named: list) -> list:
    """The structure `params_by_name` returned, with the names bound to `model`'s parameters now."""
    params = dict(model.named_parameters(remove_duplicate=False))

    def bind(names: list[str]) -> list[torch.nn.Parameter]:
        missing = [n for n in names if n not in params]
        if missing:
            raise ConfigError(f"{_KEY}: the split model has no parameter {missing[0]!r} of model_parameters; pass "
                              "the split model's parameters (tp_model_init() first) or let the config build the "
                              "optimizer")
        return [params[n] for n in names]

    if named and isinstance(named[0], dict):
        return [{**group, "params": bind(group["params"])} for group in named]
    return bind(named)
