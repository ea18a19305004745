"""Triton multi-tensor LAMB (see ops/multi_tensor and reference.lamb_step), in three launches:
  1. moments: per block, update m and v (stored), form the update u, and write the block's partial
     sums of p*p and u*u;
  2. ratios: each segment's partials are added through an fp64 prefix sum over the blocks (a fixed
     order: deterministic, unlike atomics) and turned into the trust ratio with a few torch ops;
  3. apply: recompute u from the stored m, v and the unchanged p, then p -= lr * ratio * u.
Traffic: read p, g, m, v, write m, v (1), read p, m, v, write p (3): 40 bytes per fp32 element, the
same as storing u, without its memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightspeed.ops.multi_tensor import Plan
from lightspeed.ops.multi_tensor.triton import block_of, offset_of

BLOCK = 1024  # with 4 warps: 0.99 of copy bandwidth on the H200 (sweep in benchmarks/optimizers.py)
NUM_WARPS = 4


@triton.jit
def _update(p, m, v, bc1, bc2, eps, wd, EPS_INSIDE: tl.constexpr):
    v_hat = tl.div_rn(v, bc2)
    if EPS_INSIDE:
        denom = tl.sqrt_rn(v_hat + eps)
    else:
        denom = tl.sqrt_rn(v_hat) + eps
    return tl.div_rn(tl.div_rn(m, bc1), denom) + wd * p


@triton.jit
def _moments_kernel(p_base, g_base, m_base, v_base, offsets, numels, block_segment, block_start, num_segments,
                    partials, num_blocks, scale_ptr, beta1, beta2, bc1, bc2, eps, wd,
                    HAS_SCALE: tl.constexpr, EPS_INSIDE: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    seg, start, n, full = block_of(block_segment, block_start, numels, BLOCK)
    p_ptr = p_base + offset_of(offsets, 0, num_segments, seg, ALIGN)
    g_ptr = g_base + offset_of(offsets, 1, num_segments, seg, ALIGN)
    m_ptr = m_base + offset_of(offsets, 2, num_segments, seg, ALIGN)
    v_ptr = v_base + offset_of(offsets, 3, num_segments, seg, ALIGN)
    idx = start + tl.arange(0, BLOCK)
    mask = idx < n
    p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + idx, mask=mask, other=0.0)
    v = tl.load(v_ptr + idx, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    m = m * beta1 + g * (1.0 - beta1)
    v = v * beta2 + g * g * (1.0 - beta2)
    tl.store(m_ptr + idx, m, mask=mask)
    tl.store(v_ptr + idx, v, mask=mask)
    u = tl.where(mask, _update(p, m, v, bc1, bc2, eps, wd, EPS_INSIDE), 0.0)
    pid = tl.program_id(0)
    tl.store(partials + pid, tl.sum(p * p, axis=0))
    tl.store(partials + num_blocks + pid, tl.sum(u * u, axis=0))


@triton.jit
def _apply_kernel(p_base, m_base, v_base, offsets, numels, block_segment, block_start, num_segments, ratios,
                  lr, bc1, bc2, eps, wd, EPS_INSIDE: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    seg, start, n, full = block_of(block_segment, block_start, numels, BLOCK)
    p_ptr = p_base + offset_of(offsets, 0, num_segments, seg, ALIGN)
    m_ptr = m_base + offset_of(offsets, 2, num_segments, seg, ALIGN)
    v_ptr = v_base + offset_of(offsets, 3, num_segments, seg, ALIGN)
    idx = start + tl.arange(0, BLOCK)
    mask = idx < n
    p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + idx, mask=mask, other=0.0)
    v = tl.load(v_ptr + idx, mask=mask, other=0.0)
    u = _update(p, m, v, bc1, bc2, eps, wd, EPS_INSIDE)
    p = p - (lr * tl.load(ratios + seg)) * u
    tl.store(p_ptr + idx, p.to(p_ptr.dtype.element_ty), mask=mask)


def _ratios(partials: torch.Tensor, first_block: torch.Tensor, min_coeff: float, max_coeff: float) -> torch.Tensor:
    prefix = torch.zeros(2, partials.shape[1] + 1, dtype=torch.float64, device=partials.device)
    torch.cumsum(partials.double(), dim=1, out=prefix[:, 1:])
    sums = (prefix[:, first_block[1:]] - prefix[:, first_block[:-1]]).clamp_(min=0)
    w_norm, u_norm = sums.sqrt().float()
    ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
    return torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))


def launch(arrays, plan: Plan, scale, *, lr: float, beta1: float, beta2: float, bc1: float, bc2: float, eps: float,
           weight_decay: float, eps_inside_sqrt: bool, min_coeff: float, max_coeff: float,
           num_warps: int | None = None) -> torch.Tensor:
    """Run the three kernels over `arrays` = [params, grads, exp_avgs, exp_avg_sqs]; return the trust
    ratios (fp32, one per segment, on the device)."""
    p, g, m, v = plan.bases(arrays)
    nb, ns = plan.num_blocks, plan.num_segments
    if nb == 0:
        return torch.ones(ns, dtype=torch.float32, device=p.device)
    align = 8 if plan.aligned else 1
    partials = torch.empty(2 * nb, dtype=torch.float32, device=p.device)
    _moments_kernel[(nb,)](p, g, m, v, plan.offsets, plan.numels, plan.block_segment, plan.block_start, ns,
                           partials, nb, scale if scale is not None else m, beta1, beta2, bc1, bc2, eps, weight_decay,
                           HAS_SCALE=scale is not None, EPS_INSIDE=eps_inside_sqrt, ALIGN=align, BLOCK=plan.block,
                           num_warps=num_warps or NUM_WARPS)
    ratios = _ratios(partials.view(2, nb), plan.segment_first_block, min_coeff, max_coeff)
    _apply_kernel[(nb,)](p, m, v, plan.offsets, plan.numels, plan.block_segment, plan.block_start, ns, ratios,
                         lr, bc1, bc2, eps, weight_decay, EPS_INSIDE=eps_inside_sqrt, ALIGN=align, BLOCK=plan.block,
                         num_warps=num_warps or NUM_WARPS)
    return ratios
