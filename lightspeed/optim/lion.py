"""Lion in plain PyTorch, with DeepSpeed FusedLion's parameters, defaults and update rule.

Owns the `Lion` optimizer class (the CPU path and the spec a fused kernel is tested against).
Must not: communicate, or know about flat buffers or the engine.

Note [FusedLion semantics]: per element, with gradient g and momentum m:
    c = b1*m + (1-b1)*g
    p = p*(1 - lr*weight_decay) + (-lr if c > 0 else +lr)
    m = b2*m + (1-b2)*g
The sign rule is the CUDA kernel's: c == 0 counts as negative (a step of +lr), where torch.sign
would give 0. Weight decay is decoupled. Math runs in fp32; the momentum has the parameter's dtype.
DeepSpeed's default betas are (0.9, 0.999), not the paper's (0.9, 0.99).
"""

from __future__ import annotations

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion (https://arxiv.org/abs/2302.06675). Args: params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, weight_decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1

                grad = p.grad.float()
                exp_avg = state["exp_avg"].float()
                c = exp_avg * beta1 + grad * (1 - beta1)
                direction = torch.where(c > 0, -1.0, 1.0)
                param = p.float()
                if weight_decay != 0:
                    param = param * (1.0 - lr * weight_decay)
                param = param + lr * direction
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)

                p.copy_(param)
                if state["exp_avg"].data_ptr() != exp_avg.data_ptr():
                    state["exp_avg"].copy_(exp_avg)
        return loss
