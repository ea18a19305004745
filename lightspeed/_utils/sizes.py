"""Integer size arithmetic: alignment, padding and splitting. Pure functions, no tensors."""

from __future__ import annotations


def align_up(n: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= n."""
    if multiple <= 0:
        raise ValueError(f"multiple must be positive (got {multiple})")
    return -(-n // multiple) * multiple


def padded_numel(numel: int, world_size: int, alignment: int = 1) -> int:
    """Size of a flat buffer holding `numel` elements, padded so each of `world_size` ranks owns an
    equal slice whose length is a multiple of `alignment`."""
    return align_up(numel, world_size * alignment)


def split_evenly(numel: int, num_parts: int) -> list[tuple[int, int]]:
    """[start, end) ranges splitting `numel` into `num_parts` equal parts; numel must divide evenly."""
    if numel % num_parts:
        raise ValueError(f"{numel} elements do not split evenly into {num_parts} parts")
    part = numel // num_parts
    return [(i * part, (i + 1) * part) for i in range(num_parts)]


def human_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TiB"  # unreachable, keeps type checkers quiet
