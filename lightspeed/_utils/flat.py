"""Flat buffers: tensors laid end to end in one contiguous tensor, with a view per tensor.

A `FlatLayout` is the pure arithmetic (offsets, padding); `flat_views` cuts views out of a buffer.
Nothing here communicates or knows about ranks beyond padding to a multiple of the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from lightspeed._utils.sizes import padded_numel


@dataclass(frozen=True)
class FlatLayout:
    """Where each of `shapes` lives in a flat buffer of `padded_numel` elements."""

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int  # elements actually used
    padded_numel: int  # buffer size, a multiple of world_size * alignment

    @classmethod
    def build(cls, shapes: Sequence[torch.Size], world_size: int = 1, alignment: int = 1) -> "FlatLayout":
        offsets, total = [], 0
        for shape in shapes:
            offsets.append(total)
            total += int(torch.Size(shape).numel())
        return cls(tuple(torch.Size(s) for s in shapes), tuple(offsets), total,
                   max(padded_numel(total, world_size, alignment), 0))

    def numel_of(self, index: int) -> int:
        return int(self.shapes[index].numel())

    def range_of(self, index: int) -> tuple[int, int]:
        start = self.offsets[index]
        return start, start + self.numel_of(index)


def flat_views(flat: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """One view of `flat` per tensor of `layout`, shaped like it."""
    assert flat.dim() == 1 and flat.numel() >= layout.numel, "buffer smaller than its layout"
    return [flat.narrow(0, off, int(shape.numel())).view(shape) for off, shape in zip(layout.offsets, layout.shapes)]


def flatten_into(tensors: Sequence[torch.Tensor], layout: FlatLayout, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """A new zero-padded flat buffer holding copies of `tensors` (cast to `dtype`)."""
    if not tensors and device is None:
        device = "cpu"
    dtype = dtype or tensors[0].dtype
    device = device if device is not None else tensors[0].device
    flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
    for view, t in zip(flat_views(flat, layout), tensors):
        view.copy_(t.detach())
    return flat
