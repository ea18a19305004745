"""FusedAdagrad: torch.optim.Adagrad's update (lr_decay, initial_accumulator_value, L2 weight decay)
on a Triton multi-tensor kernel; on CPU tensors it runs reference.adagrad_step. DeepSpeed has only a
CPU Adagrad; its defaults (lr=1e-2, eps=1e-10) are torch's. fp32 state and math for fp32/fp16/bf16
parameters; `step(grad_scale=..., lowp_out=...)` is the fused ZeRO step (ops/multi_tensor/optimizer.py).
"""
from __future__ import annotations

import torch

from lightspeed.ops.multi_tensor.optimizer import FusedOptimizer

from .reference import adagrad_step

__all__ = ["FusedAdagrad"]


class FusedAdagrad(FusedOptimizer):
    """Args: params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0,
    eps=1e-10, set_grad_none=True, backend="auto"."""

    _state_keys = ("sum",)
    supports_stochastic_rounding = True  # the kernel takes a rounding seed

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, set_grad_none: bool = True,
                 backend: str = "auto"):
        if min(lr, lr_decay, weight_decay, initial_accumulator_value, eps) < 0:
            raise ValueError("FusedAdagrad: lr, lr_decay, weight_decay, initial_accumulator_value and eps "
                             "must be non-negative")
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps),
                         set_grad_none=set_grad_none, backend=backend)

    def _init_extra_state(self, p: torch.Tensor, state: dict) -> None:
        for group in self.param_groups:
            if any(q is p for q in group["params"]):
                state["sum"].fill_(group["initial_accumulator_value"])
                return

    @staticmethod
    def _clr(group: dict, step: int) -> float:
        return group["lr"] / (1 + (step - 1) * group["lr_decay"])

    def _kernel_hyper(self, group, step):
        return dict(clr=self._clr(group, step), eps=group["eps"], weight_decay=group["weight_decay"])

    def _launch_kernel(self, launch, scale, hyper):
        from . import triton as kernels

        arrays, plan = launch.kernel_arrays(kernels.BLOCK)
        kernels.launch(arrays, plan, scale, **hyper, seed=self._round_seed)

    def _launch_reference(self, group, step, segments, scale):
        for s in segments:
            adagrad_step(s.param, s.grad, s.states[0], step=step, lr=self._clr(group, step), eps=group["eps"],
                         weight_decay=group["weight_decay"], grad_scale=1.0 if scale is None else scale,
                         param_lowp_out=s.out)
