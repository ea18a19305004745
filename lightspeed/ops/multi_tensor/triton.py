"""Triton helpers shared by the multi-tensor optimizer kernels (see multi_tensor/__init__.py).

Stochastic rounding (`bf16.stochastic_rounding`): `random_bits` draws four uint32 words per element of
the program's block from Philox, keyed by the launch's seed and counting (lane, program), so every
element of a launch has its own words; `round_bf16` applies ops/rounding.py's bit trick to a value
bound for a bf16 array (others pass through) before `store_as`, whose conversion is then exact.

A captured step (zero/graphed_step.py) passes a kernel's float hyperparameters as fp32 device scalars
instead of values: `launch_elementwise` sets HYPER_IN_MEMORY and each kernel reads them through
`hyper_value` (one load each), the same fp32 numbers the by-value launch receives.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def block_of(block_segment, block_start, numels, BLOCK: tl.constexpr):
    """(segment, first element of this program's block, segment length, whether the block is full)."""
    pid = tl.program_id(0)
    seg = tl.load(block_segment + pid)
    start = tl.multiple_of(tl.load(block_start + pid), BLOCK)
    n = tl.load(numels + seg)
    return seg, start, n, start + BLOCK <= n


@triton.jit
def offset_of(offsets, array: tl.constexpr, num_segments, seg, ALIGN: tl.constexpr):
    """Element offset of segment `seg` of array `array` from that array's base."""
    off = tl.load(offsets + array * num_segments + seg)
    return tl.multiple_of(off, ALIGN)


@triton.jit
def out_and_scale(p_ptr, o_base, offsets, out_array: tl.constexpr, num_segments, seg, scale_ptr,
                  HAS_OUT: tl.constexpr, HAS_SCALE: tl.constexpr, ALIGN: tl.constexpr):
    """(where the low-precision parameter copy goes: array `out_array`'s segment, or the parameter itself
    without one; the gradient scale: *scale_ptr, or 1.0 without one)."""
    o_ptr = p_ptr
    if HAS_OUT:
        o_ptr = o_base + offset_of(offsets, out_array, num_segments, seg, ALIGN)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr)
    return o_ptr, scale


@triton.jit
def load_f32(ptr, idx, n, MASKED: tl.constexpr):
    """ptr[idx] as fp32; masked (idx < n, zeros outside) only for a segment's partial last block."""
    if MASKED:
        return tl.load(ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    return tl.load(ptr + idx).to(tl.float32)


@triton.jit
def store_as(ptr, idx, value, n, MASKED: tl.constexpr):
    """ptr[idx] = value rounded to ptr's dtype (to nearest even); masked as load_f32."""
    if MASKED:
        tl.store(ptr + idx, value.to(ptr.dtype.element_ty), mask=idx < n)
    else:
        tl.store(ptr + idx, value.to(ptr.dtype.element_ty))


@triton.jit
def hyper_value(x, IN_MEMORY: tl.constexpr):
    """A float hyperparameter of the launch: passed by value, or (IN_MEMORY: a captured step, whose
    values change between replays) the fp32 at pointer `x`, written before each replay."""
    value = x
    if IN_MEMORY:
        value = tl.load(x)
    return value


@triton.jit
def random_bits(seed, BLOCK: tl.constexpr):
    """Four blocks of uint32 random words for this program's block: Philox(seed; lane, program, 0, 0)."""
    lane = tl.arange(0, BLOCK)
    program = lane * 0 + tl.program_id(0)
    zero = lane * 0
    return tl.philox(seed, lane, program, zero, zero)


@triton.jit
def round_bf16(ptr, value, bits, SR: tl.constexpr):
    """`value` (fp32) made a bf16 value stochastically with the random words `bits` when SR and `ptr`
    is a bf16 array (ops/rounding.py's Note: add 16 random bits, clear the low 16; inf/nan kept);
    otherwise `value` as it is (store_as then rounds to nearest)."""
    if SR:
        if ptr.dtype.element_ty == tl.bfloat16:
            raw = value.to(tl.uint32, bitcast=True)
            rounded = (raw + (bits & 0xFFFF)) & 0xFFFF0000
            finite = (raw & 0x7F800000) != 0x7F800000
            value = tl.where(finite, rounded, raw).to(tl.float32, bitcast=True)
    return value


def launch_elementwise(kernel, arrays, plan, scale, n_arrays: int, hyper: tuple, num_warps: int, *,
                       seed: int | None = None, **constexprs) -> None:
    """Launch an elementwise multi-tensor kernel (one program per block of `plan`) whose arguments are the
    bases of its `n_arrays` arrays, the output array's base (the params' when `arrays` has no output
    array), the plan's tables, the gradient-scale pointer (any valid pointer when `scale` is None), the
    stochastic-rounding seed (`seed`; None: round to nearest, SR false), then `hyper`: floats, or all
    0-dim fp32 device tensors the kernel reads (HYPER_IN_MEMORY: a captured step, `hyper_value`);
    HAS_SCALE, HAS_OUT, SR, ALIGN, BLOCK and HYPER_IN_MEMORY are derived, other constexprs passed through."""
    if plan.num_blocks == 0:
        return
    in_memory = any(isinstance(h, torch.Tensor) for h in hyper)
    if in_memory and not all(isinstance(h, torch.Tensor) and h.dtype == torch.float32 for h in hyper):
        raise TypeError("launch_elementwise: hyperparameters are all floats or all fp32 tensors")
    has_out = len(arrays) == n_arrays + 1
    bases = plan.bases(arrays)
    kernel[(plan.num_blocks,)](
        *bases[:n_arrays], bases[n_arrays] if has_out else bases[0],
        plan.offsets, plan.numels, plan.block_segment, plan.block_start, plan.num_segments,
        scale if scale is not None else bases[n_arrays - 1], 0 if seed is None else seed, *hyper,
        HAS_SCALE=scale is not None, HAS_OUT=has_out, SR=seed is not None, ALIGN=8 if plan.aligned else 1,
        BLOCK=plan.block, HYPER_IN_MEMORY=in_memory,
        num_warps=num_warps, **constexprs)
