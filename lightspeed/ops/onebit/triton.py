"""Triton kernels of the sign packing (same layout and results as reference.py, bit for bit).

`pack_signs`: one program per BLOCK bytes reads [BLOCK, 8] elements and sums their shifted sign bits.
`unpack_signs`: one program per BLOCK elements reads each element's byte, picks its bit and writes
+1 / -1, or +-scale of its chunk when there are scales . The kernel writes fp32 (the
optimizers' dtype); another output dtype is one torch cast of that, so it rounds as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PACK_BLOCK = 1024  # bytes per program (8192 elements)
UNPACK_BLOCK = 4096  # elements per program


@triton.jit
def _pack_kernel(x_ptr, out_ptr, n, nbytes, BLOCK: tl.constexpr):
    byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bit = tl.arange(0, 8)
    idx = byte[:, None].to(tl.int64) * 8 + bit[None, :]
    x = tl.load(x_ptr + idx, mask=idx < n, other=-1.0)
    bits = (x >= 0).to(tl.int32) << bit[None, :]
    tl.store(out_ptr + byte, tl.sum(bits, axis=1).to(tl.uint8), mask=byte < nbytes)


@triton.jit
def _unpack_kernel(packed_ptr, scale_ptr, out_ptr, n, chunk, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    byte = tl.load(packed_ptr + idx // 8, mask=mask, other=0).to(tl.int32)
    bit = (byte >> (idx % 8).to(tl.int32)) & 1
    val = bit.to(tl.float32) * 2.0 - 1.0
    if HAS_SCALE:
        val = val * tl.load(scale_ptr + idx // chunk, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, val, mask=mask)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1).contiguous()
    n = flat.numel()
    nbytes = (n + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    if nbytes:
        _pack_kernel[(triton.cdiv(nbytes, PACK_BLOCK),)](flat, out, n, nbytes, BLOCK=PACK_BLOCK)
    return out


def unpack_signs(packed: torch.Tensor, numel: int, scales: torch.Tensor | None = None, chunk: int | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if packed.dtype != torch.uint8 or packed.numel() * 8 < numel:
        raise ValueError(f"unpack_signs: need uint8 with at least {(numel + 7) // 8} bytes, got {packed.dtype} "
                         f"[{packed.numel()}]")
    if scales is not None and (chunk is None or chunk <= 0 or scales.numel() * chunk < numel):
        raise ValueError(f"unpack_signs: {scales.numel()} scales of chunk {chunk} do not cover {numel} elements")
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    if numel:
        scale_arg = scales.reshape(-1).contiguous() if scales is not None else out
        _unpack_kernel[(triton.cdiv(numel, UNPACK_BLOCK),)](packed.contiguous(), scale_arg, out, numel,
                                                            chunk or 1, HAS_SCALE=scales is not None,
                                                            BLOCK=UNPACK_BLOCK)
    return out if dtype == torch.float32 else out.to(dtype)
