"""DeepSpeed's attribute passthrough from the engine to the module it wraps.

Owns one rule, DeepSpeed's `DeepSpeedEngine.__getattr__`: a name the engine does not have resolves
on `engine.module`, so `engine.generate(...)`, `engine.gradient_checkpointing_enable()`,
`engine.config_class` or `engine.model` (a Hugging Face model's base model) are the wrapped model's.
Must not: shadow anything the engine has (its own attributes, methods and properties, then
nn.Module's parameters, buffers and submodules win), pass dunder names through (copy, pickle and
the like probe those and must see the engine's answer), or hide an AttributeError raised inside an
engine property behind the module's attribute of the same name.

Note: [forward methods] a method of the module named `forward_*` (DeepSpeed-Chat's
`engine.forward_value(...)` on its reward and critic models) is a forward by another name: it comes
back wrapped by `_as_forward` (the engine's: its strategy's `forward_method`), so at stage 3 the
model's root parameters are gathered around it as around `engine(...)`; under DeepSpeed, whose ZeRO-3
hooks sit on every module, any method works. Other methods pass through unwrapped (a wrapped
`gradient_checkpointing_enable` would count as a forward); calling `engine.module.forward_*` directly
bypasses the engine and so the wrap.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch


class ModulePassthrough:
    """Mix into an nn.Module subclass (before nn.Module) whose wrapped model is the submodule `module`."""

    def _as_forward(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """`method` of the module, to run as a forward of it (Note: [forward methods]); the engine's
        override gathers what its forward would."""
        return method

    def __getattr__(self, name: str):
        try:
            return torch.nn.Module.__getattr__(self, name)  # parameters, buffers, submodules
        except AttributeError:
            pass
        if any(name in vars(cls) for cls in type(self).__mro__):
            # the engine defines it: a property whose getter raised AttributeError. Raise that error again
            # rather than answer with the module's attribute of the same name.
            return object.__getattribute__(self, name)
        modules = self.__dict__.get("_modules")
        module = modules.get("module") if modules is not None else None
        if module is not None and not (name.startswith("__") and name.endswith("__")):
            try:
                value = getattr(module, name)
            except AttributeError:
                pass
            else:
                if name.startswith("forward_") and inspect.ismethod(value) and value.__self__ is module:
                    return self._as_forward(value)  # Note: [forward methods]
                return value
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (nor has its module "
                             f"{type(module).__name__})" if module is not None else
                             f"'{type(self).__name__}' object has no attribute '{name}'")
