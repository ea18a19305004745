"""Block-wise symmetric integer quantization of rows (int8 or int4): the plain-PyTorch spec and the CPU path.

Layout. The input is a 2-D tensor [rows, n] (a 1-D tensor is one row). Each row is cut into blocks of
`block` consecutive elements (the last one may be partial); each block gets one fp32 scale,
`absmax / qmax` with qmax = 127 (8 bits) or 7 (4 bits), and each element the code
`floor(x / scale + 0.5)` clamped to [-qmax, qmax] (round half up; a block of zeros has scale 0 and
codes 0). Codes are stored unsigned with an offset (+128 for 8 bits, +8 for 4 bits) in uint8:
8 bits one byte per element ([rows, n]); 4 bits two elements per byte, element 2i in the low nibble
and 2i + 1 in the high one ([rows, ceil(n / 2)]; a missing last element is code 0). Scales are
[rows, ceil(n / block)] fp32. Dequantization is `(code - offset) * scale` in fp32, then one rounding
to the output dtype. Rows are independent, so a buffer cut into per-rank rows can be quantized once and
its rows sent to different ranks.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}
OFFSET = {8: 128, 4: 8}


def check(bits: int, block: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"block quantization: bits must be 8 or 4, got {bits}")
    if block <= 0 or block % 2:
        raise ValueError(f"block quantization: block must be a positive even number of elements, got {block}")


def code_bytes(n: int, bits: int) -> int:
    """Bytes per row of `n` elements."""
    return n if bits == 8 else (n + 1) // 2


def num_blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(1, -1) if x.dim() == 1 else x


def quantize(x: torch.Tensor, bits: int = 8, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [rows, code_bytes(n)], scales fp32 [rows, num_blocks(n)]) of `x` [rows, n] or [n]."""
    check(bits, block)
    rows = _as_rows(x)
    r, n = rows.shape
    nb = num_blocks(n, block)
    padded = torch.zeros(r, nb * block, dtype=torch.float32, device=x.device)
    padded[:, :n] = rows
    blocks = padded.view(r, nb, block)
    qmax = QMAX[bits]
    scales = blocks.abs().amax(dim=2) / qmax
    inv = torch.where(scales > 0, 1.0 / torch.where(scales > 0, scales, 1.0), 0.0)
    codes = torch.floor(blocks * inv[:, :, None] + 0.5).clamp_(-qmax, qmax)
    codes = (codes.view(r, nb * block)[:, :n] + OFFSET[bits]).to(torch.uint8)
    if bits == 4:
        if n % 2:
            codes = torch.cat([codes, torch.full((r, 1), OFFSET[4], dtype=torch.uint8, device=x.device)], dim=1)
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes.contiguous(), scales.contiguous()


def dequantize(codes: torch.Tensor, scales: torch.Tensor, n: int, bits: int = 8, block: int = 4096,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, n] in `dtype` (or written into `out`, [rows, n] or [rows * n]) from `quantize`'s output."""
    check(bits, block)
    codes, scales = _as_rows(codes), _as_rows(scales)
    r = codes.shape[0]
    nb = num_blocks(n, block)
    if codes.dtype != torch.uint8 or codes.shape[1] != code_bytes(n, bits) or tuple(scales.shape) != (r, nb):
        raise ValueError(f"dequantize: {r} rows of {n} elements at {bits} bits need uint8 codes [{r}, "
                         f"{code_bytes(n, bits)}] and scales [{r}, {nb}], got {codes.dtype} "
                         f"{tuple(codes.shape)} and {tuple(scales.shape)}")
    if bits == 4:
        codes = torch.stack([codes & 0xF, codes >> 4], dim=2).view(r, -1)[:, :n]
    values = codes.to(torch.float32) - OFFSET[bits]
    values = values * scales.to(torch.float32).repeat_interleave(block, dim=1)[:, :n]
    if out is None:
        return values.to(dtype)
    out.view(r, n).copy_(values)
    return out
