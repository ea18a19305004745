"""Triton helpers shared by the multi-tensor optimizer kernels (see multi_tensor/__init__.py)."""
from __future__ import annotations

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
