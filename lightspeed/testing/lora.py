"""DeepSpeed-Chat's LoRA helpers (its `dschat/utils/module/lora.py`), for tests of the hybrid engine.

DeepSpeed-Chat vendors these in its own package, and the hybrid engine recognises its layers by their
attributes (`lightspeed.hybrid.lora`), so they are test helpers here, with DeepSpeed-Chat's names and
semantics: `LinearLayer_LoRA` (`lora_right_weight` [in, r], `lora_left_weight` [r, out],
`lora_scaling` = scaling / r, a `fuse_lora` flag and `fuse_lora_weight` / `unfuse_lora_weight`),
`convert_linear_layer_to_lora`, `convert_lora_to_linear_layer` (whole parameters only: under ZeRO-3,
gather them first), `only_optimize_lora_parameters`, `make_model_gradient_checkpointing_compatible`.
Owns nothing the library uses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LinearLayer_LoRA(nn.Module):  # noqa: N801 (DeepSpeed-Chat's name)
    """A linear layer `weight` [out, in] (frozen) plus the low-rank update
    `lora_scaling * lora_left_weight.t() @ lora_right_weight.t()`, unfused (two extra matmuls) unless
    `fuse_lora` is set by `fuse_lora_weight()`."""

    def __init__(self, weight: nn.Parameter, lora_dim: int = 0, lora_scaling: float = 1, lora_droppout: float = 0,
                 bias: nn.Parameter | None = None):
        super().__init__()
        if lora_dim <= 0:
            raise ValueError(f"LinearLayer_LoRA: lora_dim must be positive (got {lora_dim})")
        self.weight = weight
        self.bias = bias
        rows, columns = weight.shape
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, lora_dim))
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, rows))
        self.lora_scaling = lora_scaling / lora_dim
        self.lora_dropout = nn.Dropout(lora_droppout) if lora_droppout > 0 else nn.Identity()
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_left_weight)
        self.weight.requires_grad = False
        self.fuse_lora = False

    def _delta(self) -> torch.Tensor:
        return self.lora_scaling * torch.matmul(self.lora_left_weight.t(), self.lora_right_weight.t())

    def fuse_lora_weight(self) -> None:
        if not self.fuse_lora:
            self.weight.data += self._delta()
        self.fuse_lora = True

    def unfuse_lora_weight(self) -> None:
        if self.fuse_lora:
            self.weight.data -= self._delta()
        self.fuse_lora = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.fuse_lora:
            return out
        return out + (self.lora_dropout(x) @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def convert_linear_layer_to_lora(model: nn.Module, part_module_name: str, lora_dim: int = 0, lora_scaling: float = 1,
                                 lora_droppout: float = 0) -> nn.Module:
    """Every nn.Linear whose name contains `part_module_name` becomes a LinearLayer_LoRA over its weight."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and part_module_name in n]
    for name in names:
        linear = model.get_submodule(name)
        lora = LinearLayer_LoRA(linear.weight, lora_dim, lora_scaling, lora_droppout, linear.bias)
        _set_submodule(model, name, lora.to(linear.weight.device).to(linear.weight.dtype))
    return model


def convert_lora_to_linear_layer(model: nn.Module) -> nn.Module:
    """Fuse every LinearLayer_LoRA (whole parameters: gather ZeRO-3 ones first)."""
    for module in model.modules():
        if isinstance(module, LinearLayer_LoRA):
            module.fuse_lora_weight()
    return model


def only_optimize_lora_parameters(model: nn.Module, force_optimize_params=()) -> nn.Module:
    for name, param in model.named_parameters():
        param.requires_grad = ("lora_right_weight" in name or "lora_left_weight" in name
                               or name in force_optimize_params)
    return model


def make_model_gradient_checkpointing_compatible(model: nn.Module) -> nn.Module:
    """Inputs of the embedding require grad, so checkpointed blocks backpropagate into LoRA-only weights."""
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    elif hasattr(model, "get_input_embeddings"):
        model.get_input_embeddings().register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    return model


__all__ = ["LinearLayer_LoRA", "convert_linear_layer_to_lora", "convert_lora_to_linear_layer",
           "make_model_gradient_checkpointing_compatible", "only_optimize_lora_parameters"]
