"""Plain-PyTorch Adam/AdamW step on one tensor: the spec (DeepSpeed cpu_adam semantics).

Math (all in fp32, whatever the param/grad dtype), step counted from 1:
    g = grad * grad_scale
    if weight_decay and not adamw:  g = g + weight_decay * p          (L2, Adam)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1, 1)
    denom = sqrt(v) / sqrt(bc2) + eps
    if weight_decay and adamw:      p = p * (1 - lr * weight_decay)   (decoupled, AdamW)
    p = p - (lr / bc1) * m / denom
This is torch.optim.Adam / AdamW exactly (bias_correction=True), as DeepSpeed's kernel is.
"""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool,
              bias_correction: bool = True, grad_scale: float | torch.Tensor = 1.0,
              param_lowp_out: torch.Tensor | None = None) -> None:
    """Update ``param``, ``exp_avg``, ``exp_avg_sq`` in place; optionally write ``param_lowp_out``."""
    p = param.float()
    g = grad.float()
    if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
        g = g * grad_scale
    m = exp_avg.float()
    v = exp_avg_sq.float()
    if weight_decay and not adamw:
        g = g + weight_decay * p
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + g * g * (1 - beta2)
    if bias_correction:
        bc1 = 1 - beta1 ** step
        bc2 = 1 - beta2 ** step
    else:
        bc1 = bc2 = 1.0
    denom = v.sqrt() / math.sqrt(bc2) + eps
    if weight_decay and adamw:
        p = p * (1 - lr * weight_decay)
    p = p - (lr / bc1) * (m / denom)
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if param_lowp_out is not None:
        param_lowp_out.copy_(p.view_as(param_lowp_out))
