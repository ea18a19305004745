"""Plain-PyTorch Adagrad step on one tensor: the spec (DeepSpeed cpu_adagrad semantics).

Math in fp32:
    g = grad * grad_scale
    if weight_decay: g = g + weight_decay * p
    s = s + g * g
    p = p - lr * g / (sqrt(s) + eps)
Equals torch.optim.Adagrad with lr_decay=0 and initial_accumulator_value=0.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def adagrad_step(param: torch.Tensor, grad: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int, lr: float,
                 eps: float, weight_decay: float, grad_scale: float | torch.Tensor = 1.0,
                 param_lowp_out: torch.Tensor | None = None) -> None:
    """Update ``param`` and ``exp_avg_sq`` in place; optionally write ``param_lowp_out``."""
    del step  # DeepSpeed's Adagrad has no step-dependent term
    p = param.float()
    g = grad.float()
    if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
        g = g * grad_scale
    s = exp_avg_sq.float()
    if weight_decay:
        g = g + weight_decay * p
    s = s + g * g
    p = p - lr * (g / (s.sqrt() + eps))
    param.copy_(p)
    exp_avg_sq.copy_(s)
    if param_lowp_out is not None:
        param_lowp_out.copy_(p.view_as(param_lowp_out))
