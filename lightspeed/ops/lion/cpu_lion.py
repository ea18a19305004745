"""CPULion: DeepSpeedCPULion's behaviour with torch's vectorized CPU ops.

torch has no fused Lion kernel, so the update runs as a few vectorized in-place ops per cache-sized
chunk (p, g and m of a chunk stay in cache between the ops).
"""
from __future__ import annotations

from typing import Iterable

import torch

from lightspeed.ops.adam.cpu_adam import CHUNK_ELEMS, CPUOptimizerBase

from .reference import lion_step


class CPULion(CPUOptimizerBase):
    """DeepSpeedCPULion: sign of the interpolated momentum, decoupled weight decay."""

    _state_keys = ("exp_avg",)

    def __init__(self, model_params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True):
        super().__init__(model_params, dict(lr=lr, betas=betas, weight_decay=weight_decay),
                         fp32_optimizer_states)
        self._one = torch.ones(())
        self._tmp = torch.empty(0)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_one", torch.ones(()))
        self.__dict__.setdefault("_tmp", torch.empty(0))

    def _kernel(self, params, grads, states, steps, group):
        beta1, beta2 = group["betas"]
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        for p, g, m in zip(params, grads, states[0]):
            p, g, m = p.view(-1), g.view(-1), m.view(-1)
            n = p.numel()
            if self._tmp.numel() < min(n, CHUNK_ELEMS):
                self._tmp = torch.empty(min(n, CHUNK_ELEMS), dtype=torch.float32)
            tmp = self._tmp
            for s in range(0, n, CHUNK_ELEMS):
                e = min(n, s + CHUNK_ELEMS)
                pc, gc, mc, t = p[s:e], g[s:e], m[s:e], tmp[: e - s]
                torch.mul(mc, beta1, out=t)
                t.add_(gc, alpha=1 - beta1)
                torch.copysign(self._one, t, out=t)
                if wd:
                    pc.mul_(1 - lr * wd)
                pc.add_(t, alpha=-lr)
                mc.lerp_(gc, 1 - beta2)

    def _reference(self, p, g, states, step, group, lowp):
        beta1, beta2 = group["betas"]
        lion_step(p, g, states[0], step=step, lr=group["lr"], beta1=beta1, beta2=beta2,
                  weight_decay=group["weight_decay"], param_lowp_out=lowp)


DeepSpeedCPULion = CPULion
