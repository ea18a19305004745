"""FusedAdam: DeepSpeed's / apex's FusedAdam (signature, defaults, adam_w_mode) on a Triton
multi-tensor kernel; on CPU tensors it runs reference.adam_step and matches torch.optim.Adam/AdamW.

fp32, fp16 and bf16 parameters; the state (exp_avg, exp_avg_sq) is fp32 whatever the parameter dtype,
and the math is fp32. `step(grad_scale=..., lowp_out=...)` is the fused ZeRO step (see
ops/multi_tensor/optimizer.py).
"""
from __future__ import annotations

import math

from lightspeed.ops.multi_tensor.optimizer import FusedOptimizer

from .reference import adam_step

__all__ = ["FusedAdam"]


class FusedAdam(FusedOptimizer):
    """Adam / AdamW (decoupled weight decay when `adam_w_mode`, the default, as DeepSpeed's).

    Args: params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
    weight_decay=0.0, amsgrad=False (True raises, as DeepSpeed's), set_grad_none=True (zero_grad sets
    gradients to None), backend="auto" ("triton" / "reference" to force one).
    """

    _state_keys = ("exp_avg", "exp_avg_sq")
    supports_stochastic_rounding = True  # the kernel takes a rounding seed

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, backend: str = "auto"):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedAdam: invalid lr={lr}, eps={eps}, weight_decay={weight_decay} or betas={betas}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, set_grad_none=set_grad_none, backend=backend)
        self.adam_w_mode = bool(adam_w_mode)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("adam_w_mode", True)

    @staticmethod
    def _corrections(group: dict, step: int) -> tuple[float, float]:
        beta1, beta2 = group["betas"]
        if not group["bias_correction"]:
            return 1.0, 1.0
        return 1 - beta1 ** step, 1 - beta2 ** step

    def _kernel_hyper(self, group, step):
        bc1, bc2 = self._corrections(group, step)
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                    step_size=group["lr"] / bc1, bc2_sqrt=math.sqrt(bc2))

    def _launch_kernel(self, launch, scale, hyper):
        from . import triton as kernels

        arrays, plan = launch.kernel_arrays(kernels.BLOCK)
        kernels.launch(arrays, plan, scale, **hyper, adamw=self.adam_w_mode, seed=self._round_seed)

    def _launch_reference(self, group, step, segments, scale):
        beta1, beta2 = group["betas"]
        for s in segments:
            adam_step(s.param, s.grad, s.states[0], s.states[1], step=step, lr=group["lr"], beta1=beta1,
                      beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], adamw=self.adam_w_mode,
                      bias_correction=group["bias_correction"], grad_scale=1.0 if scale is None else scale,
                      param_lowp_out=s.out)
