"""The optimizer step of every ZeRO stage, written once over the shard views a strategy supplies.

Owns the sequence at an accumulation boundary: the inf/nan check (agreed across the group that holds
different gradients), the global gradient norm (summed over that group), the unscale/clip coefficient,
and the optimizer step, fused (the optimizer reads the low-precision gradients, applies the coefficient
and writes the low-precision parameters in one pass) or unfused (fp32 gradient copies scaled in place,
then `optimizer.step()`). Must not: know a stage, reduce gradients, or write parameters back (the
strategy does that after the step: copy, all-gather or release).

Note (agreement): `agree` is the all-reduce over the group in which the shards differ (the
data-parallel group of the sharded stages), or None when every rank holds the same whole gradients
(stage 0), where no collective is needed: each rank reaches the same decision on its own. With
`agree_norm=False` only the inf/nan decision is agreed and each rank's norm is its own: the case of
an optimizer that reduces the gradients itself (one-bit), whose ranks step on local gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightspeed.comm.codecs import AllReduce
from lightspeed.precision.overflow import flat_has_inf_or_nan
from lightspeed.zero.grad_clip import grad_coefficient, squared_norm


@dataclass
class StepResult:
    applied: bool  # False when the step was skipped (inf/nan gradients)
    grad_norm: torch.Tensor | None  # global L2 norm of the unscaled gradients (0-dim tensor)


@dataclass
class ShardViews:
    """What one strategy's step works on, built once at set-up.

    grads         the reduced gradients this rank holds (the accumulation dtype), checked for inf/nan
    master_grads  what the norm and an unfused optimizer read: fp32 copies of `grads`, or the same tensors
    opt_grads     optimizer tensor -> its gradient (a view into `master_grads`)
    lowp_out      fused step: optimizer tensor -> [(offset, low-precision tensor to write)]
    """

    optimizer: torch.optim.Optimizer | None
    fused: bool
    grads: list[torch.Tensor]
    master_grads: list[torch.Tensor]
    opt_grads: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    lowp_out: dict[torch.Tensor, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")

    @property
    def optimizer_writes_lowp(self) -> bool:
        """True when the step itself wrote the low-precision parameters (nothing to copy back)."""
        return self.optimizer is not None and self.fused


def sharded_step(views: ShardViews, loss_scale: float | None, max_norm: float, *, check_overflow: bool,
                 agree: AllReduce | None, agree_norm: bool = True) -> StepResult:
    """One optimizer step over `views` (see the module docstring). `loss_scale` None means no loss
    scaling; `check_overflow` skips the step when any gradient holds inf/nan on any rank of `agree`."""
    if check_overflow:
        flags = [flat_has_inf_or_nan(g).reshape(1) for g in views.grads]
        flag = torch.cat(flags).amax() if flags else torch.zeros((), device=views.device)
        if agree is not None:
            agree(flag, op="max")
        if bool(flag):
            return StepResult(False, None)
    for grad, master_grad in zip(views.grads, views.master_grads):
        if master_grad is not grad:
            master_grad.copy_(grad)
    sq = squared_norm(views.master_grads).to(views.device)
    if agree is not None and agree_norm:
        agree(sq)
    scale = loss_scale or 1.0
    norm = sq.sqrt() / scale
    coef = grad_coefficient(norm, scale, max_norm) if scale != 1.0 or max_norm > 0 else None
    if coef is not None and not views.fused:
        torch._foreach_mul_(views.master_grads, coef)
    if views.optimizer is not None and views.fused:
        views.optimizer.step(grads=views.opt_grads, grad_scale=coef, lowp_out=views.lowp_out)
    elif views.optimizer is not None:
        for tensor, grad in views.opt_grads.items():
            tensor.grad = grad
        views.optimizer.step()
    return StepResult(True, norm)
