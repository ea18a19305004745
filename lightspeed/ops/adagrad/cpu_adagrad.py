"""CPUAdagrad: DeepSpeedCPUAdagrad's behaviour on torch's fused CPU Adagrad kernel (see ops.adam.cpu_adam)."""
from __future__ import annotations

from typing import Iterable

import torch

from lightspeed.ops.adam.cpu_adam import CPUOptimizerBase

from .reference import adagrad_step


class CPUAdagrad(CPUOptimizerBase):
    """DeepSpeedCPUAdagrad: Adagrad with L2 weight decay, no lr decay, zero initial accumulator."""

    _state_keys = ("exp_avg_sq",)

    def __init__(self, model_params: Iterable, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):
        if amsgrad:
            raise RuntimeError("CPUAdagrad does not support the AMSGrad variant.")
        super().__init__(model_params, dict(lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad),
                         fp32_optimizer_states)

    def _kernel(self, params, grads, states, steps, group):
        step_ts = [torch.tensor(float(s)) for s in steps]
        torch._fused_adagrad_(params, grads, states[0], step_ts, lr=float(group["lr"]), lr_decay=0.0,
                              weight_decay=float(group["weight_decay"]), eps=float(group["eps"]), maximize=False)

    def _reference(self, p, g, states, step, group, lowp):
        adagrad_step(p, g, states[0], step=step, lr=group["lr"], eps=group["eps"],
                     weight_decay=group["weight_decay"], param_lowp_out=lowp)


DeepSpeedCPUAdagrad = CPUAdagrad
