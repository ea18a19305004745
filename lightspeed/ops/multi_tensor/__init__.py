"""Multi-tensor launches: many tensors (or pieces of one flat shard) updated by one kernel launch.

Owns: the launch plan (`Plan`: per-array base tensor and element offsets, per-segment lengths, and
the block -> (segment, start) table) and its cache, and the base class of the fused optimizers
(`optimizer.FusedOptimizer`). The Triton side lives in each family's `triton.py`; the only Triton
helper shared by them is `multi_tensor/triton.py`.

Note [multi-tensor addressing]: a launch covers k arrays (e.g. param, grad, exp_avg, exp_avg_sq,
low-precision copy) of S segments; segment s is k tensors of equal length n_s. Each array is passed
to the kernel as one base tensor plus an int64 table of element offsets of every segment from that
base, so no pointer is ever loaded from memory and the compiler keeps the base's 16-byte alignment.
When every offset of a launch is a multiple of ALIGN elements (and each base is 16-byte aligned), the
kernel is told so (`tl.multiple_of`) and loads full blocks as 16-byte vectors; the last, partial
block of a segment takes the masked path. Offsets assume all tensors of one array share a dtype,
which the callers group by.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Sequence

import torch

__all__ = ["Plan", "plan", "ALIGN"]

#: elements every offset must be a multiple of for the aligned (vectorized) kernel variant
ALIGN = 8
_CACHE_SIZE = 16
_cache: "OrderedDict[tuple, Plan]" = OrderedDict()


@dataclass
class Plan:
    offsets: torch.Tensor  # int64 [k, S] element offsets from each base
    numels: torch.Tensor  # int64 [S]
    block_segment: torch.Tensor  # int32 [B]: segment of each block
    block_start: torch.Tensor  # int64 [B]: first element of each block within its segment
    segment_first_block: torch.Tensor  # int64 [S + 1]: blocks of segment s are [first[s], first[s+1])
    aligned: bool
    block: int
    base_index: int  # the segment whose tensors are the arrays' bases (the first non-empty one)
    host_offsets: list[list[int]]  # the offsets on the host, one row per array
    host_numels: list[int]
    row_aligned: list[bool]  # per array: base 16-byte aligned and every offset a multiple of ALIGN

    def with_row(self, row: int, ptrs: Sequence[int], element_size: int) -> "Plan":
        """This plan with array `row`'s offsets recomputed from its segments' data pointers `ptrs`
        (same segment lengths, e.g. new gradient tensors each step): the block tables are kept, one
        small table is copied to the device."""
        offs, ok = _ptr_offsets(ptrs, self.host_numels, self.base_index, element_size)
        host = [list(r) for r in self.host_offsets]
        host[row] = offs
        row_aligned = list(self.row_aligned)
        row_aligned[row] = ok
        device = self.offsets.device
        return replace(self, offsets=torch.tensor(host, dtype=torch.int64).to(device, non_blocking=True),
                       host_offsets=host, row_aligned=row_aligned, aligned=all(row_aligned))

    def bases(self, arrays: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        return [arr[self.base_index] for arr in arrays]

    @property
    def num_blocks(self) -> int:
        return int(self.block_segment.numel())

    @property
    def num_segments(self) -> int:
        return int(self.numels.numel())


def _ptr_offsets(ptrs: Sequence[int], numels: Sequence[int], base_index: int,
                 size: int) -> tuple[list[int], bool]:
    """Element offsets of the segments at `ptrs` from segment `base_index`'s, and whether the base is
    16-byte aligned and every offset a multiple of ALIGN."""
    base_ptr = ptrs[base_index]
    offs = []
    for q, n in zip(ptrs, numels):
        if n == 0:  # no block reads it; its address may be anything
            offs.append(0)
            continue
        delta = q - base_ptr
        if delta % size:
            raise ValueError("multi-tensor launch: tensor addresses are not element-aligned")
        offs.append(delta // size)
    return offs, base_ptr % 16 == 0 and all(o % ALIGN == 0 for o in offs)


def _row_offsets(arr: Sequence[torch.Tensor], base_index: int) -> tuple[list[int], bool]:
    return _ptr_offsets([t.data_ptr() for t in arr], [t.numel() for t in arr], base_index, arr[0].element_size())


def _key(arrays: Sequence[Sequence[torch.Tensor]], block: int) -> tuple:
    return (block, tuple(tuple((t.data_ptr(), t.numel(), t.dtype) for t in arr) for arr in arrays))


def plan(arrays: Sequence[Sequence[torch.Tensor]], block: int) -> Plan:
    """The launch plan for k arrays of S contiguous segments each (empty segments dropped by the
    caller). Each array's base is its first non-empty tensor (`plan.bases(arrays)`), passed at launch; the plan holds
    no tensor of the caller's, so cached plans keep no memory alive. Cached by data pointers, so
    steady-state steps build nothing."""
    key = _key(arrays, block)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    first = arrays[0]
    device = first[0].device
    numels = [t.numel() for t in first]
    for arr in arrays:
        if len(arr) != len(first):
            raise ValueError("multi-tensor launch: arrays have different segment counts")
        for t, n in zip(arr, numels):
            if t.numel() != n or not t.is_contiguous() or t.device != device:
                raise ValueError("multi-tensor launch: segments must be contiguous, equal-length and on one device")
        if any(t.dtype != arr[0].dtype for t in arr):
            raise ValueError("multi-tensor launch: one array must have one dtype")
    base_index = next((i for i, n in enumerate(numels) if n), 0)
    rows = [_row_offsets(arr, base_index) for arr in arrays]
    offsets = [offs for offs, _ in rows]
    row_aligned = [ok for _, ok in rows]
    counts = [-(-n // block) for n in numels]
    seg_ids = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), torch.tensor(counts))
    first_block = torch.zeros(len(numels) + 1, dtype=torch.int64)
    first_block[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    starts = (torch.arange(int(first_block[-1]), dtype=torch.int64) - first_block[seg_ids.long()]) * block
    result = Plan(
        offsets=torch.tensor(offsets, dtype=torch.int64).to(device, non_blocking=True),
        numels=torch.tensor(numels, dtype=torch.int64).to(device, non_blocking=True),
        block_segment=seg_ids.to(device, non_blocking=True),
        block_start=starts.to(device, non_blocking=True),
        segment_first_block=first_block.to(device, non_blocking=True),
        aligned=all(row_aligned),
        block=block,
        base_index=base_index,
        host_offsets=offsets,
        host_numels=numels,
        row_aligned=row_aligned,
    )
    _cache[key] = result
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return result
