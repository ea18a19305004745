"""LAMB in plain PyTorch, with DeepSpeed FusedLamb's parameters and per-tensor semantics.

Owns the `Lamb` optimizer class (the CPU path and the spec a fused kernel is tested against).
Must not: communicate, or know about flat buffers or the engine.

Note [FusedLamb semantics]: per parameter tensor p with gradient g, at step t (1-based):
    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g*g
    m_hat = m / (1 - b1**t) ;  v_hat = v / (1 - b2**t)          (both divisors are 1 without bias_correction)
    u = m_hat / (sqrt(v_hat) + eps) + weight_decay * p         (sqrt(v_hat + eps) with eps_inside_sqrt)
    coeff = clamp(|p| / |u|, min_coeff, max_coeff), or 1 when |p| == 0 or |u| == 0
    p = p - lr * coeff * u
The trust ratio is per tensor, as in DeepSpeed's kernel, so results depend on how parameters are
split into tensors. `max_grad_norm > 0` divides every gradient of a group by
`(norm + 1e-6) / max_grad_norm` when that exceeds 1, `norm` being the group's global gradient norm
(FusedLamb takes that norm from its caller; the ds_config path rejects the key, as DeepSpeed does).
Math runs in fp32; the state has the parameter's dtype, as FusedLamb's does.
"""

from __future__ import annotations

import torch

__all__ = ["Lamb"]


class Lamb(torch.optim.Optimizer):
    """LAMB (https://arxiv.org/abs/1904.00962) with FusedLamb's defaults.

    Args: params (tensors or param-group dicts), lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
    eps=1e-8, eps_inside_sqrt=False, weight_decay=0.0, max_grad_norm=0.0, max_coeff=10.0,
    min_coeff=0.01, amsgrad=False (True raises, as in FusedLamb).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ):
        if amsgrad:
            raise RuntimeError("Lamb does not support the AMSGrad variant.")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Invalid min_coeff/max_coeff: {min_coeff}/{max_coeff}")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self.lamb_coeffs: list[torch.Tensor] = []

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied by the last step, one per updated tensor."""
        return [float(c) for c in self.lamb_coeffs]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grad_divisor = self._clip_divisor(params, group["max_grad_norm"])
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                self.lamb_coeffs.append(self._update(p, group, grad_divisor))
        return loss

    @staticmethod
    def _clip_divisor(params, max_grad_norm: float) -> float:
        if max_grad_norm <= 0:
            return 1.0
        norms = torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params])
        clip = (float(torch.linalg.vector_norm(norms)) + 1e-6) / max_grad_norm
        return clip if clip > 1 else 1.0

    def _update(self, p: torch.Tensor, group: dict, grad_divisor: float) -> torch.Tensor:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = state["step"]
        beta1, beta2 = group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]

        grad = p.grad.float()
        if grad_divisor != 1.0:
            grad = grad / grad_divisor
        exp_avg = state["exp_avg"].float()
        exp_avg_sq = state["exp_avg_sq"].float()
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        bias_correction1 = 1 - beta1**step if group["bias_correction"] else 1.0
        bias_correction2 = 1 - beta2**step if group["bias_correction"] else 1.0
        v_hat = exp_avg_sq / bias_correction2
        denom = (v_hat + eps).sqrt_() if self.eps_inside_sqrt else v_hat.sqrt_().add_(eps)
        update = (exp_avg / bias_correction1).div_(denom)
        param = p.float()
        if weight_decay != 0:
            update.add_(param, alpha=weight_decay)

        w_norm = torch.linalg.vector_norm(param)
        u_norm = torch.linalg.vector_norm(update)
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        coeff = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))

        new_param = param - (group["lr"] * coeff) * update
        p.copy_(new_param)
        if state["exp_avg"].data_ptr() != exp_avg.data_ptr():
            state["exp_avg"].copy_(exp_avg)
            state["exp_avg_sq"].copy_(exp_avg_sq)
        return coeff
