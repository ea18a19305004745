"""`deepspeed.compression.helper`: the module-surgery helpers (get or replace a submodule by dotted
name; turn transformers' Conv1D layers into nn.Linear), as DeepSpeed's; the compression-specific
ones raise NotImplementedError when called (model compression is not built)."""

from __future__ import annotations

import torch

from lightspeed.compat.deepspeed._missing import missing_function
from lightspeed.compat.deepspeed.compression.compress import COMPRESSION


def recursive_getattr(model, module_name: str):
    """`model.a.b.c` for `module_name` "a.b.c"."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model, module_name: str, module) -> None:
    """Set `model.a.b.c = module` for `module_name` "a.b.c"."""
    *parents, last = module_name.split(".")
    owner = recursive_getattr(model, ".".join(parents)) if parents else model
    setattr(owner, last, module)


def convert_conv1d_to_linear(model, convert_type):
    """Replace every `convert_type` layer (transformers' Conv1D: weight [in, out]) of `model` (of
    `model.module` when it has one, e.g. an engine) with an equivalent nn.Linear (weight [out, in]);
    returns `model`."""
    root = model.module if hasattr(model, "module") else model
    for name, module in list(root.named_modules()):
        if isinstance(module, convert_type):
            weight = module.weight.data
            linear = torch.nn.Linear(weight.size(0), weight.size(1), bias=module.bias is not None,
                                     device=weight.device, dtype=weight.dtype)
            linear.weight.data = weight.t().contiguous()
            if module.bias is not None:
                linear.bias.data = module.bias.data.view(-1)
            recursive_setattr(root, name, linear)
    return model


module_replacement = missing_function("deepspeed.compression.helper.module_replacement", COMPRESSION)
compression_preparation = missing_function("deepspeed.compression.helper.compression_preparation", COMPRESSION)
fix_compression = missing_function("deepspeed.compression.helper.fix_compression", COMPRESSION)
generate_pruners = missing_function("deepspeed.compression.helper.generate_pruners", COMPRESSION)

__all__ = ["compression_preparation", "convert_conv1d_to_linear", "fix_compression", "generate_pruners",
           "module_replacement", "recursive_getattr", "recursive_setattr"]
