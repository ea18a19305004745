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
