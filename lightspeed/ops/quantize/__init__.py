"""Block-wise symmetric int8 / int4 quantization of rows (ZeRO++'s wire formats): `reference.py` is
the spec and the CPU path, `triton.py` the CUDA kernels. `quantize` / `dequantize` pick Triton for
CUDA tensors unless LIGHTSPEED_OPS_BACKEND=reference."""

from __future__ import annotations

import os

import torch

from . import reference
from .reference import code_bytes, num_blocks

__all__ = ["quantize", "dequantize", "code_bytes", "num_blocks", "reference"]


def _use_triton(t: torch.Tensor) -> bool:
    backend = os.environ.get("LIGHTSPEED_OPS_BACKEND", "auto")
    if backend == "triton":
        return True
    return backend == "auto" and t.is_cuda


def quantize(x: torch.Tensor, bits: int = 8, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [rows, code_bytes(n, bits)], scales fp32 [rows, num_blocks(n, block)]) of `x`
    ([rows, n], or [n] as one row; any float dtype)."""
    if _use_triton(x):
        from . import triton as kernels

        return kernels.quantize(x, bits, block)
    return reference.quantize(x, bits, block)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int = 8, block: int = 4096,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, n] in `dtype` from `quantize`'s output, or written into `out` (contiguous, rows * n)."""
    if _use_triton(codes):
        from . import triton as kernels

        return kernels.dequantize(codes, scales, n, bits, block, dtype, out)
    return reference.dequantize(codes, scales, n, bits, block, dtype, out)
