"""Triton multi-tensor Adagrad (see ops/multi_tensor). Per element, fp32, as reference.adagrad_step and
torch.optim.Adagrad: g = grad*scale (+ wd*p); s = s + g*g; p = p - clr * g / (sqrt(s) + eps), with
clr = lr / (1 + (step-1)*lr_decay) computed by the caller.
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
def _adagrad_block(p_ptr, g_ptr, s_ptr, o_ptr, idx, n, scale, seed, clr, eps, wd,
                   HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, SR: tl.constexpr, MASKED: tl.constexpr,
                   BLOCK: tl.constexpr):
    p = load_f32(p_ptr, idx, n, MASKED)
    g = load_f32(g_ptr, idx, n, MASKED)
    s = load_f32(s_ptr, idx, n, MASKED)
    if HAS_SCALE:
        g = g * scale
    g = g + wd * p
    s = s + g * g
    p = p - clr * tl.div_rn(g, tl.sqrt_rn(s) + eps)
    if SR:
        r0, r1, _, _ = random_bits(seed, BLOCK)
        p = round_bf16(p_ptr, p, r0, SR)
        s = round_bf16(s_ptr, s, r1, SR)
    store_as(p_ptr, idx, p, n, MASKED)
    store_as(s_ptr, idx, s, n, MASKED)
    if HAS_OUT:
        store_as(o_ptr, idx, p, n, MASKED)


@triton.jit(do_not_specialize=["seed"])
def _adagrad_kernel(p_base, g_base, s_base, o_base, offsets, numels, block_segment, block_start, num_segments,
                    scale_ptr, seed, clr, eps, wd, HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr,
                    SR: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr, HYPER_IN_MEMORY: tl.constexpr):
    clr = hyper_value(clr, HYPER_IN_MEMORY)
    eps = hyper_value(eps, HYPER_IN_MEMORY)
    wd = hyper_value(wd, HYPER_IN_MEMORY)
    seg, start, n, full = block_of(block_segment, block_start, numels, BLOCK)
    p_ptr = p_base + offset_of(offsets, 0, num_segments, seg, ALIGN)
    g_ptr = g_base + offset_of(offsets, 1, num_segments, seg, ALIGN)
    s_ptr = s_base + offset_of(offsets, 2, num_segments, seg, ALIGN)
    o_ptr, scale = out_and_scale(p_ptr, o_base, offsets, 3, num_segments, seg, scale_ptr, HAS_OUT, HAS_SCALE, ALIGN)
    idx = start + tl.arange(0, BLOCK)
    if full:
        _adagrad_block(p_ptr, g_ptr, s_ptr, o_ptr, idx, n, scale, seed, clr, eps, wd, HAS_SCALE, HAS_OUT, SR, False,
                       BLOCK)
    else:
        _adagrad_block(p_ptr, g_ptr, s_ptr, o_ptr, idx, n, scale, seed, clr, eps, wd, HAS_SCALE, HAS_OUT, SR, True,
                       BLOCK)


def launch(arrays, plan: Plan, scale, *, clr: float, eps: float, weight_decay: float,
           num_warps: int | None = None, seed: int | None = None) -> None:
    """Run the kernel over `arrays` = [params, grads, sums, (outs)] with `plan`; `seed`: round the bf16
    arrays stochastically with it (multi_tensor/triton.py)."""
    launch_elementwise(_adagrad_kernel, arrays, plan, scale, 3, (clr, eps, weight_decay), num_warps or NUM_WARPS,
                       seed=seed)
