"""1-bit Adam (DeepSpeed's `OneBitAdam`; Tang et al. 2021, arXiv:2102.02888).

Owns the update rule. Warm-up (the first `freeze_step` steps): exact Adam on all-reduced gradients,
without bias correction, eps outside the square root unless `eps_inside_sqrt`, weight decay added to
the update (DeepSpeed's rule). After it the variance is frozen, the strategy leaves gradients local,
and each step updates the momentum with the local gradient and replaces it by its one-bit compressed
mean over ranks (`OneBitAllReduce`, worker and server error feedback) before the update. A param
group's `exp_avg_mask` multiplies the communicated momentum (DeepSpeed's mask for elements whose
momentum must stay exactly zero).

*Changed* from DeepSpeed: its first `step()` only initializes buffers and does not move the
parameters; here every step is a real step, so the warm-up equals Adam step for step.
"""

from __future__ import annotations

from typing import Iterable

import torch

from lightspeed.comm.onebit import OneBitAllReduce
from lightspeed.optim.onebit.common import OneBitOptimizer


def adam_direction(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, param: torch.Tensor, group: dict,
                   eps_inside_sqrt: bool) -> torch.Tensor:
    """exp_avg / (sqrt(exp_avg_sq) + eps) plus weight_decay * param (no bias correction)."""
    if eps_inside_sqrt:
        update = exp_avg / (exp_avg_sq + group["eps"]).sqrt()
    else:
        update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
    if group["weight_decay"] > 0.0:
        update.add_(param, alpha=group["weight_decay"])
    return update


class OneBitAdam(OneBitOptimizer):
    def __init__(self, params: Iterable, *, codec: OneBitAllReduce, lr: float = 1e-3, freeze_step: int = 100000,
                 betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str | None = None,
                 bias_correction: bool | None = None, group_backend: str | None = None):
        if amsgrad:
            raise ValueError("optimizer.params.amsgrad: 1-bit Adam does not support the AMSGrad variant")
        if freeze_step < 0:
            raise ValueError(f"optimizer.params.freeze_step: must be >= 0, got {freeze_step}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), codec=codec,
                         cuda_aware=cuda_aware, comm_backend_name=comm_backend_name, bias_correction=bias_correction,
                         group_backend=group_backend)
        self.freeze_step = int(freeze_step)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)

    def owns_gradient_reduction(self) -> bool:
        return self.world_size > 1 and self.steps_done() >= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        compressed = self.owns_gradient_reduction()
        stepped = self._stepped()
        for group, p in stepped:
            if p.grad.is_sparse:
                raise RuntimeError("1-bit Adam does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            grad = p.grad.float()
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            if not compressed:
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if compressed:
            self.compressed_mean([self.state[p]["exp_avg"] for _, p in stepped])
            for group, p in stepped:
                if "exp_avg_mask" in group:
                    self.state[p]["exp_avg"].mul_(group["exp_avg_mask"].to(p.device))
        for group, p in stepped:
            state = self.state[p]
            update = adam_direction(state["exp_avg"], state["exp_avg_sq"], p, group, self.eps_inside_sqrt)
            p.add_(update.to(p.dtype), alpha=-group["lr"])
        return loss
