"""Triton kernels of the block-wise quantization (the layout and results of reference.py).

One program per (row, block), on a 1-D grid (blocks of a large shard outnumber CUDA's 65535 limit on
the second grid axis). Quantize: load the block as fp32, its absmax, scale = absmax / qmax, codes
`floor(x * (1 / scale) + 0.5)` clamped, offset, stored; 4 bits load a [block / 2, 2] tile so each
row of the tile is one output byte. Dequantize: the inverse, one rounding to the output's dtype.
Offsets are int64: a 1.3B-element buffer is close to the int32 limit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import OFFSET, QMAX, check, code_bytes, num_blocks


@triton.jit
def _quant8_kernel(x_ptr, codes_ptr, scale_ptr, n, nb, QMAXF: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_P2: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row, b = pid // nb, pid % nb
    offs = tl.arange(0, BLOCK_P2)
    idx = b * BLOCK + offs
    mask = (offs < BLOCK) & (idx < n)
    x = tl.load(x_ptr + row * n + idx, mask=mask, other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), axis=0) / QMAXF
    inv = tl.where(scale > 0, 1.0 / scale, 0.0)
    code = tl.minimum(tl.maximum(tl.floor(x * inv + 0.5), -QMAXF), QMAXF) + 128.0
    tl.store(codes_ptr + row * n + idx, code.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + pid, scale)


@triton.jit
def _quant4_kernel(x_ptr, codes_ptr, scale_ptr, n, nb, cb, QMAXF: tl.constexpr, BLOCK: tl.constexpr,
                   HALF_P2: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row, b = pid // nb, pid % nb
    i = tl.arange(0, HALF_P2)
    j = tl.arange(0, 2)
    local = 2 * i[:, None] + j[None, :]
    idx = b * BLOCK + local
    mask = (local < BLOCK) & (idx < n)
    x = tl.load(x_ptr + row * n + idx, mask=mask, other=0.0).to(tl.float32)
    scale = tl.max(tl.max(tl.abs(x), axis=1), axis=0) / QMAXF
    inv = tl.where(scale > 0, 1.0 / scale, 0.0)
    code = tl.minimum(tl.maximum(tl.floor(x * inv + 0.5), -QMAXF), QMAXF) + 8.0
    byte = tl.sum(code.to(tl.int32) << (4 * j[None, :]), axis=1)
    byte_idx = b * (BLOCK // 2) + i
    tl.store(codes_ptr + row * cb + byte_idx, byte.to(tl.uint8), mask=(i < BLOCK // 2) & (2 * byte_idx < n))
    tl.store(scale_ptr + pid, scale)


@triton.jit
def _dequant8_kernel(codes_ptr, scale_ptr, out_ptr, n, nb, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row, b = pid // nb, pid % nb
    offs = tl.arange(0, BLOCK_P2)
    idx = b * BLOCK + offs
    mask = (offs < BLOCK) & (idx < n)
    code = tl.load(codes_ptr + row * n + idx, mask=mask, other=128).to(tl.float32)
    val = (code - 128.0) * tl.load(scale_ptr + pid)
    tl.store(out_ptr + row * n + idx, val.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant4_kernel(codes_ptr, scale_ptr, out_ptr, n, nb, cb, BLOCK: tl.constexpr, HALF_P2: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    row, b = pid // nb, pid % nb
    i = tl.arange(0, HALF_P2)
    j = tl.arange(0, 2)
    byte_idx = b * (BLOCK // 2) + i
    byte = tl.load(codes_ptr + row * cb + byte_idx, mask=(i < BLOCK // 2) & (2 * byte_idx < n), other=0x88)
    code = (byte.to(tl.int32)[:, None] >> (4 * j[None, :])) & 0xF
    val = (code.to(tl.float32) - 8.0) * tl.load(scale_ptr + pid)
    local = 2 * i[:, None] + j[None, :]
    idx = b * BLOCK + local
    tl.store(out_ptr + row * n + idx, val.to(out_ptr.dtype.element_ty),
             mask=(local < BLOCK) & (idx < n))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, -1) if x.dim() == 1 else x


def quantize(x: torch.Tensor, bits: int = 8, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    check(bits, block)
    rows = _rows(x).contiguous()
    r, n = rows.shape
    nb, cb = num_blocks(n, block), code_bytes(n, bits)
    codes = torch.empty(r, cb, dtype=torch.uint8, device=x.device)
    scales = torch.empty(r, nb, dtype=torch.float32, device=x.device)
    if r * nb == 0:
        return codes, scales
    grid = (r * nb,)
    if bits == 8:
        _quant8_kernel[grid](rows, codes, scales, n, nb, QMAXF=float(QMAX[8]), BLOCK=block,
                             BLOCK_P2=triton.next_power_of_2(block))
    else:
        _quant4_kernel[grid](rows, codes, scales, n, nb, cb, QMAXF=float(QMAX[4]), BLOCK=block,
                             HALF_P2=triton.next_power_of_2(block // 2))
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int = 8, block: int = 4096,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    check(bits, block)
    codes, scales = _rows(codes).contiguous(), _rows(scales).contiguous()
    r = codes.shape[0]
    nb, cb = num_blocks(n, block), code_bytes(n, bits)
    if codes.dtype != torch.uint8 or codes.shape[1] != cb or tuple(scales.shape) != (r, nb):
        raise ValueError(f"dequantize: {r} rows of {n} elements at {bits} bits need uint8 codes [{r}, {cb}] and "
                         f"scales [{r}, {nb}], got {codes.dtype} {tuple(codes.shape)} and {tuple(scales.shape)}")
    target = out if out is not None else torch.empty(r, n, dtype=dtype, device=codes.device)
    if not target.is_contiguous() or target.numel() != r * n:
        raise ValueError(f"dequantize: out must be contiguous with {r * n} elements")
    if r * nb:
        grid = (r * nb,)
        scales = scales.to(torch.float32)
        if bits == 8:
            _dequant8_kernel[grid](codes, scales, target, n, nb, BLOCK=block, BLOCK_P2=triton.next_power_of_2(block))
        else:
            _dequant4_kernel[grid](codes, scales, target, n, nb, cb, BLOCK=block,
                                   HALF_P2=triton.next_power_of_2(block // 2))
    return target if out is not None else target.view(r, n)


__all__ = ["quantize", "dequantize", "OFFSET"]
