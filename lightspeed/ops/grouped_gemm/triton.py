"""Triton kernels of `lightspeed.ops.grouped_gemm` (the results of reference.py, read on the device: no host
sync, so a MoE step can be captured in a CUDA graph).

Grouped GEMM (`grouped_mm`): out [T, N] = x_g @ w[g] per group. The grid walks (M tiles, N tiles)
(`_swizzle`: SWIZZLE M tiles at a time, for L2 reuse) with cdiv(T, BLOCK_M) + G + 1 M tiles, an upper
bound on the groups' tiles (each group rounds up once) plus the tail's (the rows past offsets[-1]).
Program m finds its tile from the offsets (`_tile_of`): the groups' tile counts, their running sum
(tl.cumsum) and the first group whose running sum passes m. A tile of the tail stores zeros; a tile
past the tail stores nothing; neither runs the K loop. B is read through strides, so w^T (the input
gradient's B) is a view, not a copy. `wgrad`: dw[g] = x_g^T @ dout_g, grid (K tiles x N tiles, swizzled
likewise; G), each program reducing its group's rows in BLOCK_T chunks; an empty group writes zeros.

Routing: `gather_rows` (permute: sorted row i is token order[i] // k, zero for a dropped route),
`combine` (unpermute's weighted sum of each token's k rows, or permute's backward with unit weights;
fp32 accumulation, routes in j order: deterministic), `scatter_rows` (unpermute's backward: each kept
route's row weight * grad, and the weight's gradient <grad, row>). One program per row, looping over H.

Note: [TRITON_INTERPRET] triton reads TRITON_INTERPRET when it is imported and when kernels are defined:
import this module lazily, after the variable is set (tests/conftest.py sets it on a machine without CUDA).

Note: [fp32 inputs] tl.dot's input precision follows torch.backends.cuda.matmul.allow_tf32 (torch's own
rule for fp32 matmuls): "ieee" unless the caller allowed TF32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _tile_of(offs_ptr, G, T, pid_m, BLOCK_M: tl.constexpr, G_P2: tl.constexpr):
    """(g, first row, end row, work) of M tile `pid_m`: work 1 for a group's tile, 0 for the tail's (zeros)
    and for none (end row = first row)."""
    gi = tl.arange(0, G_P2)
    ends = tl.load(offs_ptr + gi, mask=gi < G, other=0).to(tl.int32)
    starts = tl.load(offs_ptr + gi - 1, mask=(gi > 0) & (gi < G), other=0).to(tl.int32)
    tiles = tl.where(gi < G, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    last = tl.max(ends, 0)
    g = tl.sum((cum <= pid_m).to(tl.int32), 0)
    in_groups = pid_m < total
    sel = gi == g
    first_tile = tl.sum(tl.where(sel, cum - tiles, 0), 0)
    g_start = tl.sum(tl.where(sel, starts, 0), 0)
    g_end = tl.sum(tl.where(sel, ends, 0), 0)
    row0 = tl.where(in_groups, g_start + (pid_m - first_tile) * BLOCK_M, last + (pid_m - total) * BLOCK_M)
    row_end = tl.where(in_groups, g_end, T)
    row_end = tl.maximum(row_end, row0)
    return tl.where(in_groups, g, 0), row0, row_end, in_groups.to(tl.int32)


@triton.jit
def _swizzle(pid, num_a, num_b, GROUP: tl.constexpr):
    """(a, b) of program `pid` on a num_a x num_b grid walked GROUP a-tiles at a time (b fastest within a
    group of a-tiles): the programs running together share GROUP a-tiles and a few b-tiles in L2."""
    per_group = GROUP * num_b
    first = (pid // per_group) * GROUP
    size = tl.minimum(num_a - first, GROUP)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _grouped_mm_kernel(a_ptr, b_ptr, c_ptr, offs_ptr, T, N, G, num_m, stride_am, stride_ak, stride_bg, stride_bk,
                       stride_bn, stride_cm, stride_cn, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, G_P2: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr, SWIZZLE: tl.constexpr):
    pid_m, pid_n = _swizzle(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), SWIZZLE)
    g, row0, row_end, work = _tile_of(offs_ptr, G, T, pid_m, BLOCK_M, G_P2)
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + g.to(tl.int64) * stride_bg + ks[:, None] * stride_bk + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if work != 0:  # the tail's tiles and idle ones skip the K loop
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + ks) < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _wgrad_step(acc, x_ptr, dy_ptr, t0, end, ts, kk, nn, k_ok, n_ok, stride_xm, stride_xk, stride_ym, stride_yn,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    t = (t0 + ts).to(tl.int64)
    t_ok = t < end
    a = tl.load(x_ptr + t[None, :] * stride_xm + kk[:, None] * stride_xk, mask=k_ok[:, None] & t_ok[None, :],
                other=0.0)
    b = tl.load(dy_ptr + t[:, None] * stride_ym + nn[None, :] * stride_yn, mask=t_ok[:, None] & n_ok[None, :],
                other=0.0)
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _wgrad_kernel(x_ptr, dy_ptr, dw_ptr, offs_ptr, K, N, stride_xm, stride_xk, stride_ym, stride_yn, stride_wg,
                  stride_wk, stride_wn, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                  PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, UPCAST: tl.constexpr, SWIZZLE: tl.constexpr):
    pid_k, pid_n = _swizzle(tl.program_id(0), tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N), SWIZZLE)
    g = tl.program_id(1)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0).to(tl.int32)
    end = tl.load(offs_ptr + g).to(tl.int32)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = kk < K
    n_ok = nn < N
    ts = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    if INTERPRETED:  # the interpreter (numpy 2) cannot run `range` over a computed bound
        t0 = start
        while t0 < end:
            acc = _wgrad_step(acc, x_ptr, dy_ptr, t0, end, ts, kk, nn, k_ok, n_ok, stride_xm, stride_xk, stride_ym,
                              stride_yn, PRECISION, UPCAST)
            t0 += BLOCK_T
    else:
        for t0 in range(start, end, BLOCK_T):
            acc = _wgrad_step(acc, x_ptr, dy_ptr, t0, end, ts, kk, nn, k_ok, n_ok, stride_xm, stride_xk, stride_ym,
                              stride_yn, PRECISION, UPCAST)
    w_ptrs = dw_ptr + g.to(tl.int64) * stride_wg + kk[:, None].to(tl.int64) * stride_wk + nn[None, :] * stride_wn
    tl.store(w_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


@triton.jit
def _gather_rows_kernel(src_ptr, order_ptr, keys_ptr, out_ptr, E, H: tl.constexpr, k: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(order_ptr + i)
    keep = tl.load(keys_ptr + r) < E
    src = src_ptr + (r // k) * H
    dst = out_ptr + i * H
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        v = tl.load(src + h, mask=(h < H) & keep, other=0.0)
        tl.store(dst + h, v, mask=h < H)


@triton.jit
def _combine_kernel(src_ptr, map_ptr, w_ptr, out_ptr, H: tl.constexpr, k: tl.constexpr, HAS_W: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in range(0, k):
            row = tl.load(map_ptr + s * k + j)
            kept = row >= 0
            v = tl.load(src_ptr + tl.maximum(row, 0) * H + h, mask=(h < H) & kept, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + s * k + j).to(tl.float32)
            acc += v
        tl.store(out_ptr + s * H + h, acc.to(out_ptr.dtype.element_ty), mask=h < H)


@triton.jit
def _scatter_rows_kernel(grad_ptr, map_ptr, w_ptr, rows_ptr, gsrc_ptr, gw_ptr, H: tl.constexpr, k: tl.constexpr,
                         BLOCK_H: tl.constexpr,
                         K_P2: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, K_P2)
    dots = tl.zeros((K_P2,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        g = tl.load(grad_ptr + s * H + h, mask=h < H, other=0.0).to(tl.float32)
        for j in range(0, k):
            row = tl.load(map_ptr + s * k + j)
            kept = row >= 0
            safe = tl.maximum(row, 0)
            w = tl.load(w_ptr + s * k + j).to(tl.float32)
            tl.store(gsrc_ptr + safe * H + h, (g * w).to(gsrc_ptr.dtype.element_ty), mask=(h < H) & kept)
            v = tl.load(rows_ptr + safe * H + h, mask=(h < H) & kept, other=0.0).to(tl.float32)
            dots += tl.where(js == j, tl.sum(g * v, 0), 0.0)
    tl.store(gw_ptr + s * k + js, dots.to(gw_ptr.dtype.element_ty), mask=js < k)


def _precision(dtype: torch.dtype) -> str | None:
    """tl.dot's input_precision: fp32 per Note: [fp32 inputs]; None (the default) for 16-bit inputs."""
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _upcast(dtype: torch.dtype) -> bool:
    """The interpreter's tl.dot gives garbage for bf16 operands (Triton 3.6): there they are made fp32
    first (exact; the products are fp32 anyway)."""
    return INTERPRET and dtype == torch.bfloat16


def mm_config(T: int, N: int, K: int, dtype: torch.dtype) -> dict:
    """Block sizes and launch options of `grouped_mm` (untuned heuristics): the interpreter's small fixed
    blocks; on the GPU 128 x 128 (64 for narrow N) with BLOCK_K 64 for 16-bit inputs, 32 for fp32."""
    if INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
    block_n = 128 if N > 64 else 64
    block_k = 32 if dtype == torch.float32 else 64
    return dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8, num_stages=3 if block_k == 64 else 4)


def wgrad_config(K: int, N: int, dtype: torch.dtype) -> dict:
    if INTERPRET:
        return dict(BLOCK_K=32, BLOCK_N=32, BLOCK_T=16, num_warps=4, num_stages=1)
    block_t = 32 if dtype == torch.float32 else 64
    return dict(BLOCK_K=128, BLOCK_N=128, BLOCK_T=block_t, num_warps=8, num_stages=3)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """out [T, N] of x [T, K] (any strides) by w [G, K, N] (any strides) over int32 `offsets` [G]."""
    T, K = x.shape
    G, _, N = w.shape
    offsets = offsets.contiguous()
    out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    cfg = dict(config or mm_config(T, N, K, x.dtype))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    num_m = triton.cdiv(T, bm) + G + 1
    grid = (num_m * triton.cdiv(N, bn),)
    _grouped_mm_kernel[grid](x, w, out, offsets, T, N, G, num_m, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                             w.stride(2), out.stride(0), out.stride(1), K=K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             G_P2=max(triton.next_power_of_2(G), 2), EVEN_K=K % bk == 0,
                             PRECISION=_precision(x.dtype), UPCAST=_upcast(x.dtype),
                             SWIZZLE=cfg.pop("SWIZZLE", 8), **cfg)
    return out


def wgrad(x: torch.Tensor, dout: torch.Tensor, offsets: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """dw [G, K, N] (contiguous) with dw[g] = x_g^T @ dout_g."""
    T, K = x.shape
    N = dout.shape[1]
    G = offsets.shape[0]
    offsets = offsets.contiguous()
    dw = torch.empty(G, K, N, dtype=x.dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    cfg = dict(config or wgrad_config(K, N, x.dtype))
    bk, bn, bt = cfg.pop("BLOCK_K"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_T")
    grid = (triton.cdiv(K, bk) * triton.cdiv(N, bn), G)
    _wgrad_kernel[grid](x, dout, dw, offsets, K, N, x.stride(0), x.stride(1), dout.stride(0), dout.stride(1),
                        dw.stride(0), dw.stride(1), dw.stride(2), BLOCK_K=bk, BLOCK_N=bn, BLOCK_T=bt,
                        PRECISION=_precision(x.dtype), INTERPRETED=INTERPRET,
                        UPCAST=_upcast(x.dtype), SWIZZLE=cfg.pop("SWIZZLE", 8), **cfg)
    return dw


def _block_h(H: int) -> int:
    return min(triton.next_power_of_2(max(H, 1)), 64 if INTERPRET else 1024)


def gather_rows(tokens: torch.Tensor, order: torch.Tensor, keys: torch.Tensor, k: int,
                num_experts: int) -> torch.Tensor:
    """permute's rows: out[i] = tokens[order[i] // k], zero where keys[order[i]] >= num_experts."""
    R, H = order.shape[0], tokens.shape[1]
    out = torch.empty(R, H, dtype=tokens.dtype, device=tokens.device)
    if R and H:
        _gather_rows_kernel[(R,)](tokens, order, keys, out, num_experts, H=H, k=k, BLOCK_H=_block_h(H))
    return out


def combine(src: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """out[s] = sum_j weights[s, j] * src[row_map[s, j]] over row_map >= 0 (unit weights if None)."""
    S, k = row_map.shape
    H = src.shape[1]
    out = torch.empty(S, H, dtype=src.dtype, device=src.device)
    if S and H:
        w = weights if weights is not None else row_map
        _combine_kernel[(S,)](src, row_map, w, out, H=H, k=k, HAS_W=weights is not None, BLOCK_H=_block_h(H))
    return out


def scatter_rows(grad: torch.Tensor, row_map: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                 num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """unpermute's backward: (grad_rows [num_rows, H], zero on rows no route keeps; grad_weights [S, k])."""
    S, k = row_map.shape
    H = grad.shape[1]
    grad_rows = torch.zeros(num_rows, H, dtype=rows.dtype, device=grad.device)
    grad_w = torch.zeros(S, k, dtype=weights.dtype, device=grad.device)
    if S and H:
        _scatter_rows_kernel[(S,)](grad, row_map, weights, rows, grad_rows, grad_w, H=H, k=k, BLOCK_H=_block_h(H),
                                   K_P2=max(triton.next_power_of_2(k), 2))
    return grad_rows, grad_w
