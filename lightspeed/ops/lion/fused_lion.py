"""FusedLion: DeepSpeed's FusedLion (signature and defaults) on a Triton multi-tensor kernel; on CPU
tensors it runs reference.lion_step with the GPU kernel's sign rule (c == 0 moves by +lr, where
DeepSpeed's CPU Lion moves by -lr). fp32/fp16/bf16 parameters, fp32 momentum, fp32 math;
`step(grad_scale=..., lowp_out=...)` is the fused ZeRO step (ops/multi_tensor/optimizer.py).
"""
from __future__ import annotations

from lightspeed.ops.multi_tensor.optimizer import FusedOptimizer

from .reference import lion_step

__all__ = ["FusedLion"]


class FusedLion(FusedOptimizer):
    """Lion (https://arxiv.org/abs/2302.06675). Args: params, lr=1e-3, betas=(0.9, 0.999) (DeepSpeed's
    default), weight_decay=0.0 (decoupled), set_grad_none=True, backend="auto"."""

    _state_keys = ("exp_avg",)
    supports_stochastic_rounding = True  # the kernel takes a rounding seed

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 set_grad_none: bool = True, backend: str = "auto"):
        if lr < 0 or weight_decay < 0 or not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"FusedLion: invalid lr={lr}, weight_decay={weight_decay} or betas={betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay),
                         set_grad_none=set_grad_none, backend=backend)

    def _kernel_hyper(self, group, step):
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])

    def _launch_kernel(self, launch, scale, hyper):
        from . import triton as kernels

        arrays, plan = launch.kernel_arrays(kernels.BLOCK)
        kernels.launch(arrays, plan, scale, **hyper, seed=self._round_seed)

    def _launch_reference(self, group, step, segments, scale):
        beta1, beta2 = group["betas"]
        for s in segments:
            lion_step(s.param, s.grad, s.states[0], step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
                      weight_decay=group["weight_decay"], grad_scale=1.0 if scale is None else scale,
                      param_lowp_out=s.out, gpu_rule=True)
