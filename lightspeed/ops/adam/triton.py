"""Triton multi-tensor Adam/AdamW: one launch updates every segment of a plan (see ops/multi_tensor).

Per element, in fp32 (the same operations, in the same order, as reference.adam_step and torch's
fused Adam): g = grad*scale (+ wd*p for L2 Adam); m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
denom = sqrt(v)/sqrt(bc2) + eps; p = p*(1 - lr*wd) (AdamW); p = p - (lr/bc1) * (m/denom).
sqrt and the divisions are the IEEE round-to-nearest ones (sqrt_rn, div_rn), not the fast
approximations. Reads p, g, m, v once; writes p, m, v and (HAS_OUT) the low-precision copy once.
With SR (bf16.stochastic_rounding) the bf16 ones among p, m, v are rounded stochastically, each with
its own random word; the copy receives p's rounded value.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lightspeed.ops.multi_tensor import Plan
from lightspeed.ops.multi_tensor.triton import (block_of, hyper_value, launch_elementwise, load_f32, offset_of,
                                              out_and_scale, random_bits, round_bf16, store_as)

BLOCK = 1024  # with 4 warps: 0.99 of copy bandwidth on the H200 (sweep in benchmarks/optimizers.py)
NUM_WARPS = 4


@triton.jit
def _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, idx, n, scale, seed, lr, beta1, beta2, eps, wd, step_size,
                bc2_sqrt, ADAMW: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, SR: tl.constexpr,
                MASKED: tl.constexpr, BLOCK: tl.constexpr):
    p = load_f32(p_ptr, idx, n, MASKED)
    g = load_f32(g_ptr, idx, n, MASKED)
    m = load_f32(m_ptr, idx, n, MASKED)
    v = load_f32(v_ptr, idx, n, MASKED)
    if HAS_SCALE:
        g = g * scale
    if not ADAMW:
        g = g + wd * p
    m = m * beta1 + g * (1.0 - beta1)
    v = v * beta2 + g * g * (1.0 - beta2)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    if ADAMW:
        p = p * (1.0 - lr * wd)
    p = p - step_size * tl.div_rn(m, denom)
    if SR:
        r0, r1, r2, _ = random_bits(seed, BLOCK)
        p = round_bf16(p_ptr, p, r0, SR)
        m = round_bf16(m_ptr, m, r1, SR)
        v = round_bf16(v_ptr, v, r2, SR)
    store_as(p_ptr, idx, p, n, MASKED)
    store_as(m_ptr, idx, m, n, MASKED)
    store_as(v_ptr, idx, v, n, MASKED)
    if HAS_OUT:
        store_as(o_ptr, idx, p, n, MASKED)


@triton.jit(do_not_specialize=["seed"])
def _adam_kernel(p_base, g_base, m_base, v_base, o_base, offsets, numels, block_segment, block_start, num_segments,
                 scale_ptr, seed, lr, beta1, beta2, eps, wd, step_size, bc2_sqrt,
                 ADAMW: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, SR: tl.constexpr,
                 ALIGN: tl.constexpr, BLOCK: tl.constexpr, HYPER_IN_MEMORY: tl.constexpr):
    lr = hyper_value(lr, HYPER_IN_MEMORY)
    beta1 = hyper_value(beta1, HYPER_IN_MEMORY)
    beta2 = hyper_value(beta2, HYPER_IN_MEMORY)
    eps = hyper_value(eps, HYPER_IN_MEMORY)
    wd = hyper_value(wd, HYPER_IN_MEMORY)
    step_size = hyper_value(step_size, HYPER_IN_MEMORY)
    bc2_sqrt = hyper_value(bc2_sqrt, HYPER_IN_MEMORY)
    seg, start, n, full = block_of(block_segment, block_start, numels, BLOCK)
    p_ptr = p_base + offset_of(offsets, 0, num_segments, seg, ALIGN)
    g_ptr = g_base + offset_of(offsets, 1, num_segments, seg, ALIGN)
    m_ptr = m_base + offset_of(offsets, 2, num_segments, seg, ALIGN)
    v_ptr = v_base + offset_of(offsets, 3, num_segments, seg, ALIGN)
    o_ptr, scale = out_and_scale(p_ptr, o_base, offsets, 4, num_segments, seg, scale_ptr, HAS_OUT, HAS_SCALE, ALIGN)
    idx = start + tl.arange(0, BLOCK)
    if full:
        _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, idx, n, scale, seed, lr, beta1, beta2, eps, wd, step_size,
                    bc2_sqrt, ADAMW, HAS_SCALE, HAS_OUT, SR, False, BLOCK)
    else:
        _adam_block(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, idx, n, scale, seed, lr, beta1, beta2, eps, wd, step_size,
                    bc2_sqrt, ADAMW, HAS_SCALE, HAS_OUT, SR, True, BLOCK)


def launch(arrays, plan: Plan, scale, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
           adamw: bool, step_size: float, bc2_sqrt: float, num_warps: int | None = None,
           seed: int | None = None) -> None:
    """Run the kernel over `arrays` = [params, grads, exp_avgs, exp_avg_sqs, (outs)] with `plan`; `seed`
    (ops/rounding.py's mix_seed): round the bf16 arrays stochastically with it."""
    launch_elementwise(_adam_kernel, arrays, plan, scale, 4,
                       (lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt), num_warps or NUM_WARPS,
                       seed=seed, ADAMW=adamw)
