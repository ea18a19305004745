"""DeepSpeed's attribute passthrough from the engine to the module it wraps.

Owns one rule, DeepSpeed's `DeepSpeedEngine.__getattr__`: a name the engine does not have resolves
on `engine.module`, so `engine.generate(...)`, `engine.gradient_checkpointing_enable()`,
`engine.config_class` or `engine.model` (a Hugging Face model's base model) are the wrapped model's.
Must not: shadow anything the engine has (its own attributes, methods and properties, then
nn.Module's parameters, buffers and submodules win), pass dunder names through (copy, pickle and
the like probe those and must see the engine's answer), or hide an AttributeError raised inside an
engine property behind the module's attribute of the same name.
"""

from __future__ import annotations

import torch


class ModulePassthrough:
    """Mix into an nn.Module subclass (before nn.Module) whose wrapped model is the submodule `module`."""

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
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (nor has its module "
                             f"{type(module).__name__})" if module is not None else
                             f"'{type(self).__name__}' object has no attribute '{name}'")
