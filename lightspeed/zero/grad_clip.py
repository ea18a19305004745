"""Global gradient norm and the combined unscale/clip coefficient, on flat fp32 gradient tensors.

Everything stays on the device as 0-dim tensors: no host synchronisation on the step's hot path.
DeepSpeed's rule: clip when `norm > max_norm`, multiplying gradients by `max_norm / (norm + 1e-6)`.
"""

from __future__ import annotations

from typing import Sequence

import torch


# Note: [CPU norms] torch's CPU norm kernel loses accuracy with a tensor's length (fp32, torch 2.13, 2-core
# CPU, 2026-12-06: relative error -9e-6 at 1M elements, -3.7e-4 at 10M, -7.5e-3 at 77M), so the norm of a
# flat ZeRO buffer on the CPU was visibly off (0.19% at a 77M-parameter OPT) and so was the clip. On the
# CPU the squares are summed instead, `CPU_PIECE` elements at a time through one fp32 scratch buffer
# (torch's sum is a cascade: relative error about 1e-7 at 77M elements, fp32 or bf16, and the same time
# as one norm of the whole, 13 ms at 77M), the pieces' sums added in fp64. Device tensors keep
# `_foreach_norm`, as before.
CPU_PIECE = 1 << 20


def _cpu_squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    scratch = torch.empty(min(CPU_PIECE, max(g.numel() for g in grads)), dtype=torch.float32)
    for g in grads:
        for piece in g.reshape(-1).split(CPU_PIECE):
            squares = scratch[:piece.numel()]
            if piece.dtype == torch.float32:
                torch.mul(piece, piece, out=squares)
            else:
                squares.copy_(piece).mul_(squares)
            total += squares.sum()
    return total.float()


def squared_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all elements of `grads` (fp32, 0-dim, on the grads' device). bf16/fp16
    gradients are accumulated in fp32 (the fused ZeRO step hands them over without an fp32 copy).
    CPU tensors are summed as squares (Note: [CPU norms])."""
    live = [g for g in grads if g.numel()]
    on_cpu = [g for g in live if g.device.type == "cpu"]
    live = [g for g in live if g.device.type != "cpu"]
    norms = torch._foreach_norm(live, 2, dtype=torch.float32) if live else []
    if not norms:
        if on_cpu:
            return _cpu_squares(on_cpu)
        device = grads[0].device if grads else "cpu"
        return torch.zeros((), dtype=torch.float32, device=device)
    total = torch.stack([n.float() for n in norms]).square().sum()
    return total + _cpu_squares(on_cpu).to(total.device) if on_cpu else total


def grad_coefficient(norm: torch.Tensor, loss_scale: float, max_norm: float) -> torch.Tensor:
    """Factor to multiply loss-scaled gradients by: 1/loss_scale, times the clip factor when the
    unscaled `norm` exceeds `max_norm` (max_norm <= 0 disables clipping)."""
    coef = torch.full_like(norm, 1.0 / loss_scale)
    if max_norm > 0:
        coef = coef * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return coef
