"""One-bit compression: sign bits packed 8 per byte (reference.py: plain torch, the CPU path;
triton.py: the CUDA kernels). `pack_signs` / `unpack_signs` pick Triton for CUDA tensors unless
LIGHTSPEED_OPS_BACKEND=reference."""

from __future__ import annotations

import os

import torch

from . import reference

__all__ = ["pack_signs", "unpack_signs", "reference"]


def _use_triton(t: torch.Tensor) -> bool:
    backend = os.environ.get("LIGHTSPEED_OPS_BACKEND", "auto")
    if backend == "triton":
        return True
    return backend == "auto" and t.is_cuda


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(n / 8)]: bit k of byte i is 1 when element 8*i + k of `x` is >= 0."""
    if _use_triton(x):
        from . import triton as kernels

        return kernels.pack_signs(x)
    return reference.pack_signs(x)


def unpack_signs(packed: torch.Tensor, numel: int, scales: torch.Tensor | None = None, chunk: int | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[numel] of +1 / -1, times `scales[i // chunk]` when scales are given."""
    if _use_triton(packed):
        from . import triton as kernels

        return kernels.unpack_signs(packed, numel, scales, chunk, dtype)
    return reference.unpack_signs(packed, numel, scales, chunk, dtype)
