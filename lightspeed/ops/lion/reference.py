"""Plain-PyTorch Lion step on one tensor: the spec (DeepSpeed cpu_lion semantics).

Math in fp32:
    g = grad * grad_scale
    c = beta1 * m + (1 - beta1) * g
    if weight_decay: p = p * (1 - lr * weight_decay)
    p = p - lr * copysign(1, c)      # DeepSpeed's CPU Lion copies c's sign bit: c == +0 moves by -lr
    (gpu_rule=True: p = p + (-lr if c > 0 else +lr), DeepSpeed's GPU FusedLion: c == 0 moves by +lr)
    m = beta2 * m + (1 - beta2) * g
"""
from __future__ import annotations

import torch


@torch.no_grad()
def lion_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, step: int, lr: float,
              beta1: float, beta2: float, weight_decay: float, grad_scale: float | torch.Tensor = 1.0,
              param_lowp_out: torch.Tensor | None = None, gpu_rule: bool = False) -> None:
    """Update ``param`` and ``exp_avg`` in place; optionally write ``param_lowp_out``."""
    del step
    p = param.float()
    g = grad.float()
    if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
        g = g * grad_scale
    m = exp_avg.float()
    c = m * beta1
    c.add_(g, alpha=1 - beta1)  # same rounding as the fast path
    if weight_decay:
        p = p * (1 - lr * weight_decay)
    if gpu_rule:
        p = p + torch.where(c > 0, -lr, lr)
    else:
        p = p - lr * torch.copysign(torch.ones_like(c), c)
    m = m * beta2 + g * (1 - beta2)
    param.copy_(p)
    exp_avg.copy_(m)
    if param_lowp_out is not None:
        param_lowp_out.copy_(p.view_as(param_lowp_out))
