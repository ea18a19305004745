"""0/1 Adam (DeepSpeed's `ZeroOneAdam`; Lu et al. 2022, arXiv:2202.06009).

Owns the update rule and its two schedules (DeepSpeed's semantics, step s counted from 1):

- variance updates, while s <= var_freeze_step + 1: on steps where s % var_interval == 0 the strategy
  all-reduces the gradients exactly and both moments are updated; on the others the gradients stay
  local, their one-bit compressed mean (error feedback) updates the momentum only. After
  `var_update_scaler` variance updates, var_interval doubles.
- local steps, once the variance is frozen (s > var_freeze_step + 1): every step is local (momentum
  from the local gradient, parameters moved, the moves summed in `momentum_accumulator`); on steps
  where s % local_step_interval == 0 the ranks synchronize: the summed move, scaled back to momentum
  units by sqrt(v) + eps, is replaced by its compressed mean, which resets the momentum and replaces
  the local moves. Every `local_step_scaler` frozen steps, local_step_interval doubles, up to
  `local_step_clipper`. The error buffers are zeroed when the variance freezes (they held gradient
  errors, and now carry accumulated-move errors).

No bias correction and weight decay added to the update, as DeepSpeed. *Changed* from DeepSpeed: its
first `step()` only initializes buffers; here it is a real (exact) step.
"""

from __future__ import annotations

from typing import Iterable

import torch

from lightspeed.comm.onebit import OneBitAllReduce
from lightspeed.optim.onebit.adam import adam_direction
from lightspeed.optim.onebit.common import OneBitOptimizer

_COUNTERS = ("var_interval", "var_counter", "local_step_interval", "local_step_counter")


class ZeroOneAdam(OneBitOptimizer):
    # between two synchronizations of the local steps, each rank has moved its own parameters
    per_rank_state = ("exp_avg", "momentum_accumulator")
    per_rank_params = True

    def __init__(self, params: Iterable, *, codec: OneBitAllReduce, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 var_freeze_step: int = 100000, var_update_scaler: int = 16, local_step_scaler: int = 32678,
                 local_step_clipper: int = 16, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str | None = None, bias_correction: bool | None = None,
                 group_backend: str | None = None):
        if amsgrad:
            raise ValueError("optimizer.params.amsgrad: 0/1 Adam does not support the AMSGrad variant")
        for key, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                           ("local_step_clipper", local_step_clipper)):
            if int(value) < 1:
                raise ValueError(f"optimizer.params.{key}: must be >= 1, got {value}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), codec=codec,
                         cuda_aware=cuda_aware, comm_backend_name=comm_backend_name, bias_correction=bias_correction,
                         group_backend=group_backend)
        self.var_freeze_step, self.var_update_scaler = int(var_freeze_step), int(var_update_scaler)
        self.local_step_scaler, self.local_step_clipper = int(local_step_scaler), int(local_step_clipper)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)

    def _counters(self) -> dict:
        """The schedule counters (kept in every parameter's state, as DeepSpeed; the first one's rule)."""
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st and "var_interval" in st:
                    return {k: st[k] for k in _COUNTERS}
        return {"var_interval": 1, "var_counter": 0, "local_step_interval": 1, "local_step_counter": 0}

    def frozen(self, step: int) -> bool:
        """Whether step `step` (from 1) runs with the variance frozen (local steps)."""
        return step - 1 > self.var_freeze_step

    def owns_gradient_reduction(self) -> bool:
        if self.world_size == 1:
            return False
        s = self.steps_done() + 1
        return self.frozen(s) or s % self._counters()["var_interval"] != 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._closure_loss(closure)
        stepped = self._stepped()
        if not stepped:
            return loss
        c = self._counters()
        s = self.steps_done() + 1
        frozen = self.frozen(s)
        if frozen and not self.frozen(s - 1):
            self.reset_error_feedback()  # from now on the buffers carry errors of a different quantity
        exact = not frozen and s % c["var_interval"] == 0
        for group, p in stepped:
            state = self.state[p]
            if "step" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["momentum_accumulator"] = torch.zeros_like(p, dtype=torch.float32)
                state["lrs"] = 0.0  # learning rates summed over the local steps since the last sync
            state["step"] = s
        grads = [p.grad.float() for _, p in stepped]
        if not frozen and not exact:
            grads = [g.clone() if g is p.grad else g for g, (_, p) in zip(grads, stepped)]
            self.compressed_mean(grads)
        sync = frozen and s % c["local_step_interval"] == 0
        for (group, p), grad in zip(stepped, grads):
            state = self.state[p]
            beta1, beta2 = group["betas"]
            if exact:
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if "exp_avg_mask" in group and not frozen and not exact:
                grad.mul_(group["exp_avg_mask"].to(grad.device))
            state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            update = adam_direction(state["exp_avg"], state["exp_avg_sq"], p, group, self.eps_inside_sqrt)
            p.add_(update.to(p.dtype), alpha=-group["lr"])
            if frozen:
                state["momentum_accumulator"].add_(update, alpha=-group["lr"])
                state["lrs"] += group["lr"]
        if sync:
            accs = [self.state[p]["momentum_accumulator"] for _, p in stepped]
            denoms = []
            for (group, p), acc in zip(stepped, accs):
                p.sub_(acc.to(p.dtype))  # back to the last synchronized point
                denom = self._denom(self.state[p]["exp_avg_sq"], group)
                acc.mul_(denom)
                denoms.append(denom)
            self.compressed_mean(accs)
            for (group, p), acc, denom in zip(stepped, accs, denoms):
                if "exp_avg_mask" in group:
                    acc.mul_(group["exp_avg_mask"].to(acc.device))
                self.state[p]["exp_avg"].copy_(acc).div_(-self.state[p]["lrs"])
                p.add_((acc / denom).to(p.dtype))
                acc.zero_()
                self.state[p]["lrs"] = 0.0
        self._advance(c, exact, frozen)
        for _, p in stepped:
            self.state[p].update(c)
        return loss

    def _denom(self, exp_avg_sq: torch.Tensor, group: dict) -> torch.Tensor:
        if self.eps_inside_sqrt:
            return (exp_avg_sq + group["eps"]).sqrt()
        return exp_avg_sq.sqrt().add_(group["eps"])

    def _advance(self, c: dict, exact: bool, frozen: bool) -> None:
        """Update the schedule counters after a step (DeepSpeed's rules)."""
        if not frozen:
            if exact:
                c["var_counter"] += 1
                if c["var_counter"] == self.var_update_scaler:
                    c["var_counter"] = 0
                    c["var_interval"] *= 2
        else:
            c["local_step_counter"] += 1
            if c["local_step_counter"] == self.local_step_scaler:
                c["local_step_counter"] = 0
                c["local_step_interval"] = min(self.local_step_clipper, c["local_step_interval"] * 2)
