"""1-bit LAMB (DeepSpeed's `OneBitLamb`; Li et al. 2021, arXiv:2104.06069).

Owns the update rule (DeepSpeed's semantics, step s counted from 1):

- warm-up, s <= freeze_step: exact LAMB on all-reduced gradients (no bias correction): update =
  m / (sqrt(v) + eps) + weight_decay * p, trust ratio ||p|| / ||update|| clamped to [min_coeff,
  max_coeff] (1 when either norm is 0), and an exponential average of the ratios (`coeff_beta`)
  kept as `lamb_coeff_freeze`. At s == freeze_step, v is copied into `exp_avg_sq_fresh`.
- compression, s > freeze_step: gradients stay local. On the first such step each tensor gets a
  `scaling_coeff` (the mean over tensors of RMS(m) divided by its own RMS(m)) so all momenta have one
  magnitude in the shared flat buffer. Momentum from the local gradient, times the coefficient, is
  replaced by its one-bit compressed mean over ranks, divided back. v stays frozen; the gradient
  implied by the new momentum updates `exp_avg_sq_fresh`, and the trust ratio becomes
  lamb_coeff_freeze * factor, factor = max(denom_frozen / denom_fresh) (blended by the weight-decay
  share of the update), clamped to [factor_min, factor_max] and to a change of at most
  `factor_threshold` from the last step's.

*Changed* from DeepSpeed: its first `step()` only initializes buffers; here it is a real step. The
last trust ratios are kept in `lamb_coeffs` (DeepSpeed's attribute, for logging). The per-tensor
numbers (lamb_coeff_freeze, last_factor, scaling_coeff) live in the param group under `SCALARS_KEY`,
one list entry per tensor of the group, not in `state`: checkpoints keep one value of each scalar
state per param group, and these differ from tensor to tensor.
"""

from __future__ import annotations

from typing import Iterable

import torch

from lightspeed.comm.onebit import OneBitAllReduce
from lightspeed.optim.onebit.common import OneBitOptimizer

SCALARS_KEY = "onebit_lamb_scalars"


class OneBitLamb(OneBitOptimizer):
    def __init__(self, params: Iterable, *, codec: OneBitAllReduce, lr: float = 1e-3, freeze_step: int = 100000,
                 betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str | None = None, coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1, bias_correction: bool | None = None,
                 group_backend: str | None = None):
        if amsgrad:
            raise ValueError("optimizer.params.amsgrad: 1-bit LAMB does not support the AMSGrad variant")
        if freeze_step < 0:
            raise ValueError(f"optimizer.params.freeze_step: must be >= 0, got {freeze_step}")
        if not min_coeff <= max_coeff or not factor_min <= factor_max:
            raise ValueError("optimizer.params: 1-bit LAMB needs min_coeff <= max_coeff and factor_min <= factor_max")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff),
                         codec=codec, cuda_aware=cuda_aware, comm_backend_name=comm_backend_name,
                         bias_correction=bias_correction, group_backend=group_backend)
        self.freeze_step = int(freeze_step)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self.coeff_beta, self.factor_max, self.factor_min = float(coeff_beta), float(factor_max), float(factor_min)
        self.factor_threshold = float(factor_threshold)
        self.lamb_coeffs: list[float] = []
        self._index: dict[int, int] = {}  # id(param) -> its position in its group (the scalars' index)

    def owns_gradient_reduction(self) -> bool:
        return self.world_size > 1 and self.steps_done() >= self.freeze_step

    def _scalars(self, group: dict, p: torch.Tensor) -> tuple[dict, int]:
        """The group's per-tensor scalars and `p`'s index in them."""
        n = len(group["params"])
        table = group.setdefault(SCALARS_KEY, {"lamb_coeff_freeze": [0.0] * n, "last_factor": [1.0] * n,
                                               "scaling_coeff": [None] * n})
        index = self._index.get(id(p))
        if index is None or group["params"][index] is not p:  # built once (and again if the groups change)
            self._index = {id(q): i for g in self.param_groups for i, q in enumerate(g["params"])}
            index = self._index[id(p)]
        return table, index

    def _denom(self, v: torch.Tensor, group: dict) -> torch.Tensor:
        return (v + group["eps"]).sqrt() if self.eps_inside_sqrt else v.sqrt().add_(group["eps"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        stepped = self._stepped()
        self.lamb_coeffs = []
        if not stepped:
            return loss
        s = self.steps_done() + 1
        for _, p in stepped:
            state = self.state[p]
            if "step" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq_fresh"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] = s
        if s <= self.freeze_step:
            self._warmup_step(stepped, s)
        else:
            self._compressed_step(stepped)
        return loss

    def _warmup_step(self, stepped, s: int) -> None:
        for group, p in stepped:
            state = self.state[p]
            beta1, beta2 = group["betas"]
            grad = p.grad.float()
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if s == self.freeze_step:
                state["exp_avg_sq_fresh"].copy_(state["exp_avg_sq"])
            update = state["exp_avg"] / self._denom(state["exp_avg_sq"], group)
            if group["weight_decay"] > 0.0:
                update.add_(p, alpha=group["weight_decay"])
            weight_norm, update_norm = float(p.float().norm()), float(update.norm())
            coeff = 1.0
            if weight_norm != 0 and update_norm != 0:
                coeff = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
            if coeff != 1.0:
                table, i = self._scalars(group, p)
                table["lamb_coeff_freeze"][i] = (self.coeff_beta * table["lamb_coeff_freeze"][i]
                                                 + (1 - self.coeff_beta) * coeff)
            self.lamb_coeffs.append(coeff)
            p.add_(update.to(p.dtype), alpha=-group["lr"] * coeff)

    def _compressed_step(self, stepped) -> None:
        where = [self._scalars(group, p) for group, p in stepped]
        if any(table["scaling_coeff"][i] is None for table, i in where):
            rms = [float(self.state[p]["exp_avg"].norm()) / self.state[p]["exp_avg"].numel() ** 0.5 for _, p in stepped]
            united = sum(rms) / len(rms)
            for (table, i), r in zip(where, rms):
                table["scaling_coeff"][i] = united / r if r > 0 else 1.0
        coeffs = [table["scaling_coeff"][i] for table, i in where]
        last = [self.state[p]["exp_avg"].clone() for _, p in stepped]
        for (group, p), coeff in zip(stepped, coeffs):
            beta1 = group["betas"][0]
            self.state[p]["exp_avg"].mul_(beta1).add_(p.grad.float(), alpha=1 - beta1).mul_(coeff)
        self.compressed_mean([self.state[p]["exp_avg"] for _, p in stepped])
        for (group, p), m_last, coeff, (table, i) in zip(stepped, last, coeffs, where):
            state = self.state[p]
            beta1, beta2 = group["betas"]
            m = state["exp_avg"].div_(coeff)
            if "exp_avg_mask" in group:
                m.mul_(group["exp_avg_mask"].to(m.device))
            grad = (m - m_last * beta1) / (1 - beta1)
            state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = self._denom(state["exp_avg_sq"], group)
            prelim = m / denom
            update = prelim + p.float() * group["weight_decay"] if group["weight_decay"] > 0.0 else prelim
            factor = float((denom / self._denom(state["exp_avg_sq_fresh"], group)).max())
            if group["weight_decay"] > 0.0:
                update_norm = float(update.norm())
                ratio = min(1.0, float(prelim.norm()) / update_norm) if update_norm > 0 else 1.0
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last_factor = table["last_factor"][i]
            factor = min(max(factor, last_factor * (1.0 - self.factor_threshold)),
                         last_factor * (1.0 + self.factor_threshold))
            table["last_factor"][i] = factor
            trust = table["lamb_coeff_freeze"][i] * factor
            self.lamb_coeffs.append(trust)
            p.add_(update.to(p.dtype), alpha=-group["lr"] * trust)
