"""The inverse of one Adam/AdamW step (DeepSpeed SuperOffload's algebraic rollback): from the stepped
master and moments and the gradient the step read, the values before the step, in plain PyTorch.

The forward is torch's fused CPU kernel (``torch._fused_adam_`` / ``torch._fused_adamw_``, what
`CPUAdam` runs on fp32), every operation in fp32 with the double hyperparameters cast to fp32:
    g  = grad / grad_scale                       (grad_scale: the kernel's divisor, when given)
    g  = g + p * wd                              (Adam: L2 decay)
    p' = p * (1 - lr * wd)                       (AdamW: decoupled decay; p' = p without it)
    m1 = m * beta1 + g * (1 - beta1)
    v1 = v * beta2 + g * g * (1 - beta2)
    d  = sqrt(v1) / sqrt(bc2) + eps              (eps outside the square root)
    p1 = p' - (lr / bc1) * m1 / d                (bc1, bc2: 1 - beta**step, 1 without bias correction)
Undone in this order: the update from m1, v1 (the same fp32 values the kernel computed), p' = p1 +
update, p = p' / (1 - lr * wd) (AdamW); then, with the recovered p for Adam's L2 term, g, and
m = (m1 - g * (1 - beta1)) / beta1, v = max(0, (v1 - g * g * (1 - beta2)) / beta2). At step 1 the
moments were zeros and are set so exactly.

Not exact: each recovered value is within a few fp32 rounding errors of the larger terms it was
computed from (the master within about one ulp of the master, the moments within a few ulps of the
stepped moments: ``(v1 - (1 - beta2) g^2)`` cancels when the gradient dominates the history).
AMSGrad (a running max) has no inverse; low-precision masters or state would lose the bits the
inverse needs, so `CPUAdam` offers it for fp32 masters and state only.
"""
from __future__ import annotations

import math

import torch

#: elements undone per chunk (two fp32 temporaries of this size). Each of the ~10 elementwise ops per
#: chunk is one parallel region: on a 2-core host shared with other work (2026-12-05, 38M elements,
#: min / median / max of 5) 256K gave 50 / 51 / 9639 ms, 1M 42 / 43 / 2581 ms, 2M 43 / 45 / 462 ms,
#: 8M 71 / 74 / 82 ms: fewer regions wait less on descheduled threads, past 2M the chunk leaves cache
CHUNK_ELEMS = 2 * 1024 * 1024


@torch.no_grad()
def adam_undo_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool,
               bias_correction: bool = True, grad_scale: torch.Tensor | None = None) -> None:
    """Undo the Adam/AdamW step `step` (see the module docstring) of the flat fp32 tensors in place.
    `grad` is the gradient the step read, `grad_scale` the divisor the kernel was given (None: none)."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if any(t.dtype != torch.float32 for t in tensors):
        raise ValueError("adam_undo_: the inverse step needs fp32 params, gradients and state")
    if bias_correction:
        bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    else:
        bc1 = bc2 = 1.0
    step_size, bc2_sqrt = lr / bc1, math.sqrt(bc2)
    decay = float(weight_decay)
    p_all, g_all, m_all, v_all = (t.view(-1) for t in tensors)
    n = p_all.numel()
    scratch = torch.empty(2, min(n, CHUNK_ELEMS), dtype=torch.float32)  # the denominator, the gradient
    for lo in range(0, n, CHUNK_ELEMS):
        hi = min(n, lo + CHUNK_ELEMS)
        p, g, m, v = p_all[lo:hi], g_all[lo:hi], m_all[lo:hi], v_all[lo:hi]
        # the update from the stepped moments (the kernel's denominator; its quotient within an ulp)
        d = torch.sqrt(v, out=scratch[0, : hi - lo]).div_(bc2_sqrt).add_(eps)
        p.addcdiv_(m, d, value=step_size)
        if decay and adamw:
            p.div_(1 - lr * decay)
        if step <= 1:
            m.zero_()
            v.zero_()
            continue
        gs = g if grad_scale is None else torch.div(g, grad_scale, out=scratch[1, : hi - lo])
        if decay and not adamw:
            gs = torch.add(gs, p, alpha=decay, out=scratch[1, : hi - lo])
        m.sub_(gs, alpha=1 - beta1).div_(beta1)
        v.addcmul_(gs, gs, value=-(1 - beta2)).div_(beta2).clamp_(min=0.0)
