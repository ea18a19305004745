"""Plain-PyTorch LAMB step on one tensor: the spec (DeepSpeed FusedLamb semantics).

Per parameter tensor p with gradient g, at step t (1-based), in fp32:
    g = grad * grad_scale
    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g*g
    v_hat = v / bc2 ;  denom = sqrt(v_hat) + eps   (sqrt(v_hat + eps) with eps_inside_sqrt)
    u = (m / bc1) / denom + weight_decay * p        (bc1, bc2 = 1 - b**t, or 1 without bias_correction)
    coeff = clamp(|p| / |u|, min_coeff, max_coeff), or 1 when |p| == 0 or |u| == 0
    p = p - lr * coeff * u
The trust ratio is per tensor, as in DeepSpeed's kernel, so results depend on how parameters are
split into tensors.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def lamb_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
              step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
              bias_correction: bool = True, eps_inside_sqrt: bool = False, max_coeff: float = 10.0,
              min_coeff: float = 0.01, grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Update ``param``, ``exp_avg``, ``exp_avg_sq`` in place; return the trust ratio (0-dim fp32)."""
    g = grad.float()
    if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
        g = g * grad_scale
    m = exp_avg.float() * beta1 + g * (1 - beta1)
    v = exp_avg_sq.float() * beta2 + g * g * (1 - beta2)
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    v_hat = v / bc2
    denom = (v_hat + eps).sqrt() if eps_inside_sqrt else v_hat.sqrt() + eps
    p = param.float()
    update = (m / bc1) / denom + weight_decay * p
    w_norm = torch.linalg.vector_norm(p)
    u_norm = torch.linalg.vector_norm(update)
    ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
    coeff = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))
    param.copy_(p - (lr * coeff) * update)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    return coeff
