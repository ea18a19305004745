"""The dequantization side of ops/wquant's Triton code: the bit tricks that turn packed FP6 / INT8 /
INT4 codes into fp16/bf16 weight tiles (shared with the matmul kernels in `kernels.py`) and the
prefill path, which dequantizes a whole weight once (`dequantize_weight`, one program per storage
chunk, bit-identical to `reference.dequantize`) for `dense_matmul`'s cuBLAS products. Imports
triton: import lazily (see `triton.py`'s Note on TRITON_INTERPRET, which holds here too)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lightspeed.ops.wquant.ptx import FP6_PACK2, FP6_PACK4, INT4_PAIRS, INT8_PAIRS
from lightspeed.ops.wquant.reference import FP6_FP16_SCALE, ROW_GROUP, QuantizedWeight, plane_specs

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FORMAT_ID = {"fp6": 0, "int8": 1, "int4": 2}
_FORMAT_NAME = {i: name for name, i in FORMAT_ID.items()}
DEQUANT_CHUNK_ELEMS = 1 << 26  # the dense path dequantizes at most this many weight values at a time


# the storage geometry (reference.py's Note) as compile-time constants of the kernels (FORMAT = FORMAT_ID)
@triton.constexpr_function
def unit_bytes(FORMAT):
    """Bytes of one w element as the kernels load it (`packed_units`): int8's 32-bit words, else half-words."""
    return 4 if _FORMAT_NAME[FORMAT] == "int8" else 2


@triton.constexpr_function
def hi_row_bytes(FORMAT, TILE):
    """Bytes of a row's K-tile in the w elements (int8's bytes, the 4-bit plane's nibbles); fp6's lo bytes
    (TILE / 4 per row) follow the chunk's hi rows."""
    return TILE if _FORMAT_NAME[FORMAT] == "int8" else TILE // 2


@triton.constexpr_function
def chunk_bytes(FORMAT, TILE, ROWS):
    """Bytes of one storage chunk: ROWS rows x one K-tile, each row's w elements then fp6's lo bytes (ROWS x
    `reference.tile_bytes`, which a test checks)."""
    return ROWS * (hi_row_bytes(FORMAT, TILE) + (TILE // 4 if _FORMAT_NAME[FORMAT] == "fp6" else 0))


@triton.jit
def dequant_fields(w, lo, FORMAT: tl.constexpr, X_BF16: tl.constexpr, INTERPRETED: tl.constexpr,
                    SWAP: tl.constexpr):
    """The int16 half-word tile `w` (int8: int32 word tile; fp6: with the int8 `lo` tile, same shape) -> the
    4 field weight tiles in x's dtype: fp6 as value * 2**-12, int4 / int8 as q (exact). fp16 on the GPU:
    inline asm on 32-bit pairs (`pack=2`: one register holds half-words c, c+1; int8: two registers, words
    c, c+1); else the same bits one value at a time."""
    if (not INTERPRETED) and (not X_BF16):
        if FORMAT == 1:
            v0, v1, v2, v3 = tl.inline_asm_elementwise(INT8_PAIRS, "=r,=r,=r,=r,r,r", [w],
                                                       dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                       is_pure=True, pack=2)
        elif FORMAT == 0 and SWAP:
            v0, v1, v2, v3 = tl.inline_asm_elementwise(FP6_PACK2, "=r,=r,=r,=r,r,r", [w, lo],
                                                       dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                       is_pure=True, pack=2)
        elif FORMAT == 0:
            v0, v1, v2, v3 = tl.inline_asm_elementwise(FP6_PACK4, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [w, lo],
                                                       dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                       is_pure=True, pack=4)
        else:
            v0, v1, v2, v3 = tl.inline_asm_elementwise(INT4_PAIRS, "=r,=r,=r,=r,r", [w],
                                                       dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                       is_pure=True, pack=2)
    else:
        h = w.to(tl.int32)
        if FORMAT == 1:
            v0 = _int8_value(h & 0xFF, X_BF16)
            v1 = _int8_value((h >> 8) & 0xFF, X_BF16)
            v2 = _int8_value((h >> 16) & 0xFF, X_BF16)
            v3 = _int8_value((h >> 24) & 0xFF, X_BF16)
        elif FORMAT == 0:
            lb = lo.to(tl.int32) & 0xFF
            l16 = lb | (lb << 8)  # the byte twice (reference.py's Note: one formula per field)
            v0 = _fp6_bits((h << 9) & 0x1E00, l16 & 0x8100, X_BF16)
            v1 = _fp6_bits((((h & 0x00F0) | (l16 & 0xFF0F)) << 5) & 0x9F00, 0, X_BF16)
            v2 = _fp6_bits(h & 0x0F00, (l16 << 3) & 0x9000, X_BF16)
            v3 = _fp6_bits((h >> 3) & 0x1E00, (l16 << 2) & 0x8100, X_BF16)
        else:
            v0 = _int4_value(h & 0xF, X_BF16, INTERPRETED)
            v1 = _int4_value((h >> 4) & 0xF, X_BF16, INTERPRETED)
            v2 = _int4_value((h >> 8) & 0xF, X_BF16, INTERPRETED)
            v3 = _int4_value((h >> 12) & 0xF, X_BF16, INTERPRETED)
    return v0, v1, v2, v3


@triton.jit
def _fp6_bits(a, b, X_BF16: tl.constexpr):
    """The fp16 (or bf16) value with bits a | b (the masked parts of one fp6 field)."""
    v = (a | b).to(tl.int16).to(tl.float16, bitcast=True)
    if X_BF16:
        v = v.to(tl.bfloat16)
    return v


@triton.jit
def _int4_value(c, X_BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    """c = q + 8 -> q: fp16 bits 0x6400 | c == 1024 + c (bf16: 0x4300 | c == 128 + c)."""
    if X_BF16:
        v = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        if INTERPRETED:  # the interpreter has no bf16 scalars; fp32 is exact here
            v = v.to(tl.float32) - 136.0
        else:
            v = v - 136.0
    else:
        v = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
    return v


@triton.jit
def pick_field(f: tl.constexpr, v0, v1, v2, v3):
    if f == 0:
        r = v0
    elif f == 1:
        r = v1
    elif f == 2:
        r = v2
    else:
        r = v3
    return r


@triton.jit
def _int8_value(b, X_BF16: tl.constexpr):
    """b = the byte of q (0..255) -> q in x's dtype: fp16 bits 0x6400 | (b ^ 0x80) == 1024 + q + 128 (bf16:
    that fp16 value converted, exact for |q| <= 128)."""
    v = ((b ^ 0x80) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
    if X_BF16:
        v = v.to(tl.bfloat16)
    return v


@triton.jit
def _dequant_kernel(w_ptr, w2_ptr, s_ptr, out_ptr, N, G0, N_END, K: tl.constexpr, TILE: tl.constexpr,
                    GROUP: tl.constexpr, FORMAT: tl.constexpr, OUT_SCALE: tl.constexpr, INTERPRETED: tl.constexpr,
                    ROWS: tl.constexpr):
    """out [N_END - G0 * ROWS, K] (fp16/bf16) = rows G0 * ROWS .. N_END - 1 of code value * scale, rounded
    once from fp32 (bit-identical to `reference.dequantize(qw, dtype)`). One program per storage chunk
    (row group G0 + program 0, K-tile program 1)."""
    NG: tl.constexpr = K // GROUP
    CHUNK: tl.constexpr = chunk_bytes(FORMAT, TILE, ROWS)
    grp = G0 + tl.program_id(0)
    t = tl.program_id(1)
    rin = tl.arange(0, ROWS)
    offs_n = grp * ROWS + rin
    # bytes (K-tile major chunks); the chunk holds ROWS rows (padded past N)
    base = (t * tl.cdiv(N, ROWS) + grp) * CHUNK
    FW: tl.constexpr = TILE // 4
    offs_c = tl.arange(0, FW)
    w = tl.load(w_ptr + base // unit_bytes(FORMAT) + rin[:, None] * FW + offs_c[None, :])
    lo = w
    if FORMAT == 0:
        lo = tl.load(w2_ptr + base + ROWS * hi_row_bytes(FORMAT, TILE) + rin[:, None] * FW + offs_c[None, :])
    v0, v1, v2, v3 = dequant_fields(w, lo, FORMAT, False, INTERPRETED, False)
    for f in tl.static_range(4):
        _store_scaled(out_ptr, s_ptr, pick_field(f, v0, v1, v2, v3), offs_n, t * TILE + f * FW + offs_c, N, G0 * ROWS,
                      N_END, K, GROUP, NG, OUT_SCALE)


@triton.jit
def _store_scaled(out_ptr, s_ptr, v, offs_n, offs_k, N, row0, N_END, K: tl.constexpr, GROUP: tl.constexpr,
                  NG: tl.constexpr, OUT_SCALE: tl.constexpr):
    """out[n - row0, k] = v * (scale[n, k // GROUP] * OUT_SCALE) in fp32, one rounding to out's dtype, for
    rows n < N_END."""
    mask = (offs_n < N_END)[:, None] & (offs_k < K)[None, :]
    nc = tl.minimum(offs_n, N - 1)
    g = tl.minimum(offs_k // GROUP, NG - 1)
    s = tl.load(s_ptr + nc[:, None] * NG + g[None, :]).to(tl.float32) * OUT_SCALE
    tl.store(out_ptr + (offs_n - row0)[:, None] * K + offs_k[None, :],
             (v.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The dense weight [N, K] (or its rows n0..n1-1, n0 a multiple of ROW_GROUP) in fp16/bf16 (value *
    scale, rounded once: what `reference.dequantize` gives in that dtype), by one Triton pass over the
    packed chunks."""
    N, K = qw.shape
    check_planes(qw)
    n0, n1 = rows if rows is not None else (0, N)
    if n0 % ROW_GROUP or not 0 <= n0 < n1 <= N:
        raise ValueError(f"rows must be (n0, n1) with n0 a multiple of {ROW_GROUP} and 0 <= n0 < n1 <= {N}")
    group = qw.group_size if qw.group_size is not None else K
    packed = qw.planes[0]
    out = torch.empty((n1 - n0, K), device=packed.device, dtype=dtype)
    grid = (triton.cdiv(n1 - n0, ROW_GROUP), triton.cdiv(K, qw.tile))
    _dequant_kernel[grid](packed_units(qw), packed, qw.scales.contiguous(),
                          out, N, n0 // ROW_GROUP, n1, K=K, TILE=qw.tile, GROUP=group, FORMAT=FORMAT_ID[qw.format],
                          OUT_SCALE=FP6_FP16_SCALE if qw.format == "fp6" else 1.0, INTERPRETED=INTERPRET,
                          ROWS=ROW_GROUP, num_warps=4)
    return out


def _row_step(K: int) -> int:
    """Rows of W per dequantized chunk: about DEQUANT_CHUNK_ELEMS values, a multiple of ROW_GROUP."""
    return max(ROW_GROUP, DEQUANT_CHUNK_ELEMS // K // ROW_GROUP * ROW_GROUP)


def dense_matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) through the dense weight, dequantized in row chunks of about DEQUANT_CHUNK_ELEMS
    values so the transient copy stays bounded (128 MB in fp16) whatever the layer's size."""
    N, K = qw.shape
    step = _row_step(K)
    if step >= N:
        w = dequantize_weight(qw, x.dtype)
        return torch.matmul(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
    out = torch.empty((x.shape[0], N), device=x.device, dtype=x.dtype)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        w = dequantize_weight(qw, x.dtype, (n0, n1))
        out[:, n0:n1] = torch.matmul(x, w.t()) if bias is None else torch.addmm(bias[n0:n1], x, w.t())
    return out


def dense_grad_input(grad: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """grad @ W ([R, N] -> [R, K], grad's dtype: the input gradient of y = x @ W.T) through the dense
    weight, dequantized in row chunks as in `dense_matmul`; chunks' products summed in fp32."""
    N, K = qw.shape
    step = _row_step(K)
    if step >= N:
        return torch.matmul(grad, dequantize_weight(qw, grad.dtype))
    out = torch.zeros((grad.shape[0], K), device=grad.device, dtype=torch.float32)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        out += torch.matmul(grad[:, n0:n1], dequantize_weight(qw, grad.dtype, (n0, n1)))
    return out.to(grad.dtype)


def packed_units(qw: QuantizedWeight) -> torch.Tensor:
    """The packed weight as the kernels read it: int8 as 32-bit words, fp6's hi / int4's 4-bit plane as
    half-words (fp6's lo plane is read through the int8 tensor itself)."""
    return qw.planes[0].view(torch.int32 if qw.format == "int8" else torch.int16)


def check_planes(qw: QuantizedWeight) -> None:
    N, K = qw.shape
    if qw.planes[0].numel() >= 2**31:  # the kernels address the packed bytes with 32-bit offsets
        raise ValueError(f"packed weight [{N}, {K}] {qw.format} takes {qw.planes[0].numel()} bytes; the kernels take "
                         f"< 2 GiB per layer (split the layer)")
    for plane, (shape, dtype) in zip(qw.planes, plane_specs(qw.format, N, K, qw.tile)):
        if tuple(plane.shape) != shape or plane.dtype != dtype or not plane.is_contiguous():
            raise ValueError(f"{qw.format} plane must be a contiguous {dtype} {shape} (got {plane.dtype} "
                             f"{tuple(plane.shape)})")
