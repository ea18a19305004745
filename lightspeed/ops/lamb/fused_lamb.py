"""FusedLamb: DeepSpeed's FusedLamb (signature, defaults, per-tensor trust ratio) on Triton kernels;
on CPU tensors it runs reference.lamb_step. fp32/fp16/bf16 parameters, fp32 state and math.

`max_grad_norm > 0` divides every gradient of a group by `(norm + 1e-6) / max_grad_norm` when that
exceeds 1, `norm` being the group's global gradient norm (kept on the device). `get_lamb_coeffs()`
returns the trust ratios of the last step. The trust ratio is per tensor, so `step(lowp_out=...)`
(which would split tensors into pieces) is refused; `grad_scale` is accepted.
"""
from __future__ import annotations

import torch

from lightspeed.ops.multi_tensor.optimizer import FusedOptimizer

from .reference import lamb_step

__all__ = ["FusedLamb"]


class FusedLamb(FusedOptimizer):
    """LAMB (https://arxiv.org/abs/1904.00962). Args: params, lr=1e-3, bias_correction=True,
    betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False, weight_decay=0.0, max_grad_norm=0.0,
    max_coeff=10.0, min_coeff=0.01, amsgrad=False (True raises, as DeepSpeed's), set_grad_none=True,
    backend="auto"."""

    _state_keys = ("exp_avg", "exp_avg_sq")
    fuses_lowp_out = False

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False,
                 set_grad_none: bool = True, backend: str = "auto"):
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant.")
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedLamb: invalid lr={lr}, eps={eps}, weight_decay={weight_decay} or betas={betas}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"FusedLamb: invalid min_coeff/max_coeff: {min_coeff}/{max_coeff}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults, set_grad_none=set_grad_none, backend=backend)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self.lamb_coeffs: list[torch.Tensor] = []
        self._clip_scale: torch.Tensor | None = None

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("eps_inside_sqrt", False)
        self.__dict__.setdefault("lamb_coeffs", [])
        self.__dict__.setdefault("_clip_scale", None)

    def get_lamb_coeffs(self) -> list[float]:
        """Trust ratios applied by the last step, one per updated tensor (synchronises with the device)."""
        return [float(c) for coeffs in self.lamb_coeffs for c in coeffs.reshape(-1)]

    @torch.no_grad()
    def step(self, closure=None, *, grads=None, grad_scale=None, lowp_out=None):
        if lowp_out:
            raise ValueError("FusedLamb: lowp_out is not supported (the trust ratio is per whole tensor)")
        self.lamb_coeffs = []
        return super().step(closure, grads=grads, grad_scale=grad_scale)

    def _before_group(self, group: dict, grads) -> None:
        self._clip_scale = None
        if group["max_grad_norm"] <= 0:
            return
        live = [grads.get(p, p.grad) if grads is not None else p.grad for p in group["params"]]
        live = [g for g in live if g is not None]
        if not live:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in live]))
        clip = (norm + 1e-6) / group["max_grad_norm"]
        self._clip_scale = torch.where(clip > 1, 1.0 / clip, torch.ones_like(clip))

    def _hyper(self, group: dict, step: int, scale):
        beta1, beta2 = group["betas"]
        bc1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
        bc2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
        clip = self._clip_scale
        if clip is not None:
            scale = clip if scale is None else scale * clip
        return beta1, beta2, bc1, bc2, scale

    def _launch_triton(self, group, step, launch, scale):
        from . import triton as kernels

        beta1, beta2, bc1, bc2, scale = self._hyper(group, step, scale)
        arrays, plan = launch.kernel_arrays(kernels.BLOCK, with_out=False)
        self.lamb_coeffs.append(kernels.launch(
            arrays, plan, scale, lr=group["lr"], beta1=beta1, beta2=beta2, bc1=bc1, bc2=bc2,
            eps=group["eps"], weight_decay=group["weight_decay"], eps_inside_sqrt=self.eps_inside_sqrt,
            min_coeff=group["min_coeff"], max_coeff=group["max_coeff"]))

    def _launch_reference(self, group, step, segments, scale):
        beta1, beta2, _, _, scale = self._hyper(group, step, scale)
        coeffs = [lamb_step(s.param, s.grad, s.states[0], s.states[1], step=step, lr=group["lr"], beta1=beta1,
                            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                            bias_correction=group["bias_correction"], eps_inside_sqrt=self.eps_inside_sqrt,
                            max_coeff=group["max_coeff"], min_coeff=group["min_coeff"],
                            grad_scale=1.0 if scale is None else scale) for s in segments]
        self.lamb_coeffs.append(torch.stack(coeffs))
