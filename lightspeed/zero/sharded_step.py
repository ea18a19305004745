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

Note (before the norm): an optimizer with `before_norm(opt_grads, loss_scale)` rewrites its gradients
after the overflow check and before the norm (Muon at ZeRO 1-3 puts its orthogonalised update there,
so the norm and the clip are taken over the update, as DeepSpeed's ZeRO optimizers do).

Note (placements): with `views.norm` set (zero/norm.py: some parameter is sharded over a mesh dim
beyond the data-parallel partition, e.g. tensor parallelism), the norm's partial squares are those of
the plan's counted views, summed over the plan's group, which takes the place of the agreement for the
norm; the inf/nan decision is agreed over that group as well.
"""


from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightspeed._utils.device import synchronize
from lightspeed.comm.codecs import AllReduce
from lightspeed.precision.overflow import flat_has_inf_or_nan
from lightspeed.zero.grad_clip import grad_coefficient, squared_norm
from lightspeed.zero.graphed_step import GraphedStep
from lightspeed.zero.norm import NormPlan


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
    norm_grads    what the norm reads when not `master_grads`: with the optimizer offloaded, the
                  device-side `grads` (the norm is computed where the gradients were reduced, and
                  `master_grads` are host copies)
    """

    optimizer: torch.optim.Optimizer | None
    fused: bool
    grads: list[torch.Tensor]
    master_grads: list[torch.Tensor]
    opt_grads: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    lowp_out: dict[torch.Tensor, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    norm_grads: list[torch.Tensor] | None = None
    norm: NormPlan | None = None  # set when a placement is sharded beyond data parallelism (see the Note)
    # optimizer offload copies each reduced shard to its host `master_grads` entry as it completes:
    # `early_filled` holds the ids of those entries, and `master_grads_filled` (set by the strategy
    # for one step) says the copies of this step were made, so the step does not copy them again
    early_filled: frozenset = frozenset()
    master_grads_filled: bool = False
    # False: the step copies no gradient into host `master_grads` (ZenFlow copies what an update needs)
    host_copies: bool = True
    # optimizer.cuda_graph: the fused step's launches captured once and replayed (zero/graphed_step.py)
    graphed: GraphedStep | None = None

    @property
    def optimizer_writes_lowp(self) -> bool:
        """True when the step itself wrote the low-precision parameters (nothing to copy back)."""
        return self.optimizer is not None and self.fused


def prepare_step(views: ShardViews, loss_scale: float | None, max_norm: float, *, check_overflow: bool,
                 agree: AllReduce | None, agree_norm: bool = True) -> tuple[StepResult, torch.Tensor | None]:
    """Everything of the step before the optimizer: the overflow decision, the copy of the gradients
    into `master_grads`, the global norm, and the unscale/clip coefficient (applied to `master_grads`
    here when the step is unfused). Returns the result and the coefficient `apply_step` needs."""
    if check_overflow:
        flags = [flat_has_inf_or_nan(g).reshape(1) for g in views.grads]
        flag = torch.cat(flags).amax() if flags else torch.zeros((), device=views.device)
        if agree is not None:
            agree(flag, op="max")
        if views.norm is not None:
            views.norm.all_reduce(flag, op="max")
        if bool(flag):
            return StepResult(False, None), None
    to_host = False
    for grad, master_grad in zip(views.grads, views.master_grads):
        if master_grad is not grad and views.host_copies and not (views.master_grads_filled
                                                                  and id(master_grad) in views.early_filled):
            # device -> host (offload): cast on the device, copied straight into the page-locked host
            # buffer; a blocking copy_ would stage through pageable memory and cast on the host
            down = grad.device.type != "cpu" and master_grad.device.type == "cpu"
            master_grad.copy_(grad, non_blocking=down)
            to_host |= down
    if to_host:
        synchronize(views.device)  # the host buffers are read next (the norm or the CPU optimizer)
    before_norm = getattr(views.optimizer, "before_norm", None)
    if before_norm is not None:  # Muon at ZeRO 1-3: the orthogonalised update takes the gradient's place
        before_norm(views.opt_grads, loss_scale)
    if views.norm is None:
        sq = squared_norm(views.norm_grads if views.norm_grads is not None else views.master_grads).to(views.device)
        if agree is not None and agree_norm:
            agree(sq)
    else:
        sq = squared_norm(views.norm.counted).to(views.device)
        views.norm.all_reduce(sq)
    scale = loss_scale or 1.0
    norm = sq.sqrt() / scale
    coef = grad_coefficient(norm, scale, max_norm) if scale != 1.0 or max_norm > 0 else None
    if coef is not None and not views.fused and views.master_grads:
        # the master gradients may live in host memory (optimizer offload), some of them on the device
        # (partial offload): the factor goes to each device's list
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in views.master_grads:
            by_device.setdefault(g.device, []).append(g)
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(device))
    return StepResult(True, norm), coef


def apply_step(views: ShardViews, coef: torch.Tensor | None, optimizer: torch.optim.Optimizer | None = None) -> None:
    """The optimizer step of a prepared step. `optimizer` replaces `views.optimizer` (the overlapped
    offload step hands a snapshot of its hyperparameters)."""
    optimizer = optimizer if optimizer is not None else views.optimizer
    if optimizer is not None and views.fused and views.graphed is not None:
        views.graphed.step(views.opt_grads, views.lowp_out, coef, views.device)
    elif optimizer is not None and views.fused:
        optimizer.step(grads=views.opt_grads, grad_scale=coef, lowp_out=views.lowp_out)
    elif optimizer is not None:
        for tensor, grad in views.opt_grads.items():
            tensor.grad = grad
        optimizer.step()
        for tensor in views.opt_grads:  # views of gradient buffers released after the step (grad_buffers.py)
            tensor.grad = None


def sharded_step(views: ShardViews, loss_scale: float | None, max_norm: float, *, check_overflow: bool,
                 agree: AllReduce | None, agree_norm: bool = True) -> StepResult:
    """One optimizer step over `views` (see the module docstring). `loss_scale` None means no loss
    scaling; `check_overflow` skips the step when any gradient holds inf/nan on any rank of `agree`."""
    result, coef = prepare_step(views, loss_scale, max_norm, check_overflow=check_overflow, agree=agree,
                                agree_norm=agree_norm)
    if result.applied:
        apply_step(views, coef)
    return result
