"""Triton multi-tensor Lion (see ops/multi_tensor). Per element, fp32, as reference.lion_step:
g = grad*scale; c = b1*m + (1-b1)*g; p = p*(1 - lr*wd); p = p + (-lr if c > 0 else +lr) (DeepSpeed's
GPU FusedLion rule: c == 0 moves by +lr); m = b2*m + (1-b2)*g.
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
def _lion_block(p_ptr, g_ptr, m_ptr, o_ptr, idx, n, scale, seed, lr, beta1, beta2, wd,
                HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, SR: tl.constexpr, MASKED: tl.constexpr,
                BLOCK: tl.constexpr):
    p = load_f32(p_ptr, idx, n, MASKED)
    g = load_f32(g_ptr, idx, n, MASKED)
    m = load_f32(m_ptr, idx, n, MASKED)
    if HAS_SCALE:
        g = g * scale
    c = m * beta1 + g * (1.0 - beta1)
    p = p * (1.0 - lr * wd)
    p = p + tl.where(c > 0, -lr, lr)
    m = m * beta2 + g * (1.0 - beta2)
    if SR:
        r0, r1, _, _ = random_bits(seed, BLOCK)
        p = round_bf16(p_ptr, p, r0, SR)
        m = round_bf16(m_ptr, m, r1, SR)
    store_as(p_ptr, idx, p, n, MASKED)
    store_as(m_ptr, idx, m, n, MASKED)
    if HAS_OUT:
        store_as(o_ptr, idx, p, n, MASKED)


@triton.jit(do_not_specialize=["seed"])
def _lion_kernel(p_base, g_base, m_base, o_base, offsets, numels, block_segment, block_start, num_segments,
                 scale_ptr, seed, lr, beta1, beta2, wd, HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr,
                 SR: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr, HYPER_IN_MEMORY: tl.constexpr):
    lr = hyper_value(lr, HYPER_IN_MEMORY)
    beta1 = hyper_value(beta1, HYPER_IN_MEMORY)
    beta2 = hyper_value(beta2, HYPER_IN_MEMORY)
    wd = hyper_value(wd, HYPER_IN_MEMORY)
    seg, start, n, full = block_of(block_segment, block_start, numels, BLOCK)
    p_ptr = p_base + offset_of(offsets, 0, num_segments, seg, ALIGN)
    g_ptr = g_base + offset_of(offsets, 1, num_segments, seg, ALIGN)
    m_ptr = m_base + offset_of(offsets, 2, num_segments, seg, ALIGN)
    o_ptr, scale = out_and_scale(p_ptr, o_base, offsets, 3, num_segments, seg, scale_ptr, HAS_OUT, HAS_SCALE, ALIGN)
    idx = start + tl.arange(0, BLOCK)
    if full:
        _lion_block(p_ptr, g_ptr, m_ptr, o_ptr, idx, n, scale, seed, lr, beta1, beta2, wd, HAS_SCALE, HAS_OUT, SR,
                    False, BLOCK)
    else:
        _lion_block(p_ptr, g_ptr, m_ptr, o_ptr, idx, n, scale, seed, lr, beta1, beta2, wd, HAS_SCALE, HAS_OUT, SR,
                    True, BLOCK)


def launch(arrays, plan: Plan, scale, *, lr: float, beta1: float, beta2: float, weight_decay: float,
           num_warps: int | None = None, seed: int | None = None) -> None:
    """Run the kernel over `arrays` = [params, grads, exp_avgs, (outs)] with `plan`; `seed`: round the bf16
    arrays stochastically with it (multi_tensor/triton.py)."""
    launch_elementwise(_lion_kernel, arrays, plan, scale, 3, (lr, beta1, beta2, weight_decay), num_warps or NUM_WARPS,
                       seed=seed)
