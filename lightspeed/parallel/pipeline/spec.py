"""DeepSpeed's layer specifications: a layer described by its class and arguments, built only on the
stage that holds it (`LayerSpec`), and a layer whose module is shared by several positions of the
pipeline, such as tied input and output embeddings (`TiedLayerSpec`).

Owns: the two spec classes. Must not: know stages or build anything but the one module asked for.
"""

from __future__ import annotations

import torch


class LayerSpec:
    """`typename(*module_args, **module_kwargs)`, built when `build()` is called (DeepSpeed's
    `deepspeed.pipe.LayerSpec`); `typename` must be an `nn.Module` class."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, torch.nn.Module)):
            raise RuntimeError(f"LayerSpec only supports torch.nn.Module types (got {typename!r})")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> torch.nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer sharing one module with every other `TiedLayerSpec` of the same `key`; at each position
    it runs `forward_fn(module, x)` when given, else `module(x)`. `tied_weight_attr` names the
    attributes (dotted paths) whose gradients are summed over the positions (DeepSpeed: ["weight"])."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",), **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
