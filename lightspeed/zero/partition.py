"""Shard-ownership arithmetic on flat buffers: pure functions on integers, tested without processes.

A flat buffer of `padded_numel` elements (a multiple of the world size) is split into equal ranges;
rank r owns `[r*n/W, (r+1)*n/W)`. `Range` intersections say which part of a parameter a rank owns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """Half-open interval [start, end) of flat-buffer indices."""

    start: int
    end: int

    @property
    def numel(self) -> int:
        return max(self.end - self.start, 0)

    def intersect(self, other: "Range") -> "Range":
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, max(start, end))

    def shift(self, offset: int) -> "Range":
        return Range(self.start + offset, self.end + offset)


def shard_range(padded_numel: int, world_size: int, rank: int) -> Range:
    """The range of a flat buffer owned by `rank`."""
    if padded_numel % world_size:
        raise ValueError(f"flat buffer of {padded_numel} elements is not padded to world size {world_size}")
    part = padded_numel // world_size
    return Range(rank * part, (rank + 1) * part)


def bucket_ranges(param_ranges: list[Range], bucket_numel: int) -> list[tuple[int, int]]:
    """Group consecutive parameters (given by their flat ranges, in buffer order) into buckets of at
    least `bucket_numel` elements each (the last may be smaller). Returns [first, last+1) parameter
    index pairs. A parameter is never split across buckets; `bucket_numel` <= 0 means one bucket."""
    buckets, first, filled = [], 0, 0
    for i, r in enumerate(param_ranges):
        filled += r.numel
        if bucket_numel > 0 and filled >= bucket_numel:
            buckets.append((first, i + 1))
            first, filled = i + 1, 0
    if first < len(param_ranges):
        buckets.append((first, len(param_ranges)))
    return buckets


@dataclass(frozen=True)
class BucketPlan:
    """One bucket of a flat buffer: parameters [first, last) (buffer order) at elements
    [start, start + padded_numel); `padded_numel` is a multiple of the world size, and rank r owns
    the r-th of its `world_size` equal chunks."""

    first: int
    last: int
    start: int
    padded_numel: int

    def chunk(self, world_size: int, rank: int) -> Range:
        size = self.padded_numel // world_size
        return Range(self.start + rank * size, self.start + (rank + 1) * size)


def plan_flat(numels: list[int], bucket_numel: int, world_size: int = 1) -> tuple[list[int], list[BucketPlan], int]:
    """Lay parameters of `numels` (in buffer order) end to end in buckets of about `bucket_numel`
    elements, each padded to a multiple of `world_size`. Returns (offset of each parameter, the
    buckets, total buffer size). Sharding by bucket chunks (not one range of the whole buffer) lets
    every bucket be reduce-scattered and all-gathered on its own."""
    spans = bucket_ranges([Range(0, n) for n in numels], bucket_numel)
    offsets: list[int] = []
    buckets: list[BucketPlan] = []
    start = 0
    for first, last in spans:
        pos = start
        for n in numels[first:last]:
            offsets.append(pos)
            pos += n
        padded = max(-(-(pos - start) // world_size) * world_size, world_size)
        buckets.append(BucketPlan(first, last, start, padded))
        start += padded
    return offsets, buckets, start


def owned_chunks(buckets: list[BucketPlan], world_size: int, rank: int) -> list[tuple[Range, int]]:
    """This rank's chunk of every bucket, with where it starts in the rank's contiguous shard."""
    out, shard_pos = [], 0
    for b in buckets:
        r = b.chunk(world_size, rank)
        out.append((r, shard_pos))
        shard_pos += r.numel
    return out


def uncovered(whole: Range, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The sub-ranges of `whole` not covered by the sorted, disjoint `taken` ranges."""
    out, pos = [], whole.start
    for a, b in sorted(taken):
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < whole.end:
        out.append((pos, whole.end))
    return out
