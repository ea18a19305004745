"""Global gradient norm and the combined unscale/clip coefficient, on flat fp32 gradient tensors.

Everything stays on the device as 0-dim tensors: no host synchronisation on the step's hot path.
DeepSpeed's rule: clip when `norm > max_norm`, multiplying gradients by `max_norm / (norm + 1e-6)`.
"""

from __future__ import annotations

from typing import Sequence

import torch


def squared_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all elements of `grads` (fp32, 0-dim, on the grads' device). bf16/fp16
    gradients are accumulated in fp32 (the fused ZeRO step hands them over without an fp32 copy)."""
    live = [g for g in grads if g.numel()]
    norms = torch._foreach_norm(live, 2, dtype=torch.float32) if live else []
    if not norms:
        device = grads[0].device if grads else "cpu"
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([n.float() for n in norms]).square().sum()


def grad_coefficient(norm: torch.Tensor, loss_scale: float, max_norm: float) -> torch.Tensor:
    """Factor to multiply loss-scaled gradients by: 1/loss_scale, times the clip factor when the
    unscaled `norm` exceeds `max_norm` (max_norm <= 0 disables clipping)."""
    coef = torch.full_like(norm, 1.0 / loss_scale)
    if max_norm > 0:
        coef = coef * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return coef
