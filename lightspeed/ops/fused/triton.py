"""Triton kernels of `lightspeed.ops.fused` (the results of reference.py; every launcher reads shapes only,
never tensor values, so nothing syncs with the host and torch.compile can trace the launches).

- RMSNorm: forward one row per program (fp32 statistics, the normalised row rounded to x's dtype before
  the weight scales it, as HF does), saving 1/rms; backward 4 programs per SM (4 on CPU), each over a
  contiguous block of rows, dx per row and a partial dw per program (summed by torch after).
- RoPE: one program per (i0, i1, i2) row of a 4-D q or k read through its strides (HF's q is a
  transposed view), cos / sin broadcast through stride-0 dimensions; the backward is the same kernel
  with the rotation's sign flipped.
- SwiGLU: elementwise over flat contiguous inputs; the backward recomputes sigmoid(gate).
- Cross-entropy chunk: one program per row of a logits chunk; an online max / sum-of-exp pass over the
  vocabulary in BLOCK_V blocks (and the sum of the logits, for label smoothing), then a second pass that
  overwrites the logits with the gradient of (row loss * scale). Optional soft-capping cap * tanh(z / cap)
  (tanh through sigmoid: the interpreter has no libdevice).

Note: [loop bounds] The loops' bounds are constexpr (the vocabulary size, RMSNorm's rows per program):
triton 3.6's interpreter cannot run a loop over a runtime bound (under numpy 2), and on the GPU each
value compiles once (a training run sees one vocabulary and few row counts).

Note: [TRITON_INTERPRET] triton reads TRITON_INTERPRET when it is imported and when kernels are defined:
import this module lazily, after the variable is set (tests/conftest.py sets it on a machine without CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_FUSED_SIZE = 65536 // 4  # one program's row in registers (fp32 elements); RMSNorm refuses wider rows


def _programs(device: torch.device, rows: int) -> int:
    if device.type == "cuda":
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))


# ------------------------------------------------------------------------------------------------ RMSNorm
@triton.jit
def _rms_fwd(x_ptr, x_stride, w_ptr, y_ptr, y_stride, rstd_ptr, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x_raw = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    n = (x * rstd).to(x_raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + cols, (n * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_bwd(dy_ptr, dy_stride, x_ptr, x_stride, w_ptr, rstd_ptr, dx_ptr, dx_stride, dw_ptr, M, N,
             ROWS_PER_PROG: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(0, ROWS_PER_PROG):
        row = pid.to(tl.int64) * ROWS_PER_PROG + i
        live = mask & (row < M)
        x_raw = tl.load(x_ptr + row * x_stride + cols, mask=live, other=0.0)
        x = x_raw.to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_stride + cols, mask=live, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < M, other=0.0)
        xhat = x * rstd
        dw += dy * xhat.to(x_raw.dtype).to(tl.float32)
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / N))
        tl.store(dx_ptr + row * dx_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=live)
    tl.store(dw_ptr + pid * N + cols, dw, mask=mask)


def _warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y with x's leading shape in promote(x, weight) dtype, rstd [rows] fp32)."""
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    if block > MAX_FUSED_SIZE:
        raise ValueError(f"rms_norm: the triton kernel holds a row in one program; hidden size {n} is over "
                         f"{MAX_FUSED_SIZE}")
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _rms_fwd[(x2.shape[0],)](x2, x2.stride(0), weight, y, y.stride(0), rstd, n, eps, BLOCK_N=block,
                                 num_warps=_warps(block))
    return y.view(x.shape), rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2, dy2 = _rows(x), _rows(dy)
    rows = x2.shape[0]
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    progs = _programs(x.device, rows)
    partial = torch.zeros(progs, n, dtype=torch.float32, device=x.device)
    if rows:
        _rms_bwd[(progs,)](dy2, dy2.stride(0), x2, x2.stride(0), weight, rstd, dx, dx.stride(0), partial, rows, n,
                           ROWS_PER_PROG=triton.cdiv(rows, progs), BLOCK_N=triton.next_power_of_2(n),
                           num_warps=_warps(triton.next_power_of_2(n)))
    return dx.view(x.shape), partial.sum(0).to(weight.dtype)


# ------------------------------------------------------------------------------------------------ RoPE
@triton.jit
def _rope(x_ptr, xs0, xs1, xs2, c_ptr, s_ptr, cs0, cs1, cs2, y_ptr, d1, d2, HALF, SIGN: tl.constexpr,
          BLOCK_H: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    i0 = pid // (d1 * d2)
    rest = pid % (d1 * d2)
    i1 = rest // d2
    i2 = rest % d2
    cols = tl.arange(0, BLOCK_H)
    mask = cols < HALF
    xb = x_ptr + i0 * xs0 + i1 * xs1 + i2 * xs2
    cb = i0 * cs0 + i1 * cs1 + i2 * cs2
    x1 = tl.load(xb + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(c_ptr + cb + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + cb + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr + cb + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + cb + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    if SIGN > 0:  # forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    else:  # backward (the transpose): dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 - dy1 s1
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    yb = y_ptr + pid * (2 * HALF)
    tl.store(yb + cols, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(yb + HALF + cols, y2.to(y_ptr.dtype.element_ty), mask=mask)


def rope_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """Rotate the 4-D `x` (last dim contiguous or not: copied then); `cos` / `sin` already broadcast to x's
    shape (stride-0 views). Returns a contiguous tensor of x's shape in promote(x, cos) dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    d0, d1, d2, d = x.shape
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if y.numel():
        _rope[(d0 * d1 * d2,)](x, x.stride(0), x.stride(1), x.stride(2), cos, sin, cos.stride(0), cos.stride(1),
                               cos.stride(2), y, d1, d2, d // 2, SIGN=-1 if backward else 1,
                               BLOCK_H=triton.next_power_of_2(d // 2))
    return y


# ------------------------------------------------------------------------------------------------ SwiGLU
@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(du_ptr + offs, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(dg_ptr.dtype.element_ty), mask=mask)


SWIGLU_BLOCK = 1024


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    n = y.numel()
    if n:
        _swiglu_fwd[(triton.cdiv(n, SWIGLU_BLOCK),)](gate, up, y, n, BLOCK=SWIGLU_BLOCK)
    return y


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy = dy.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _swiglu_bwd[(triton.cdiv(n, SWIGLU_BLOCK),)](dy, gate, up, dg, du, n, BLOCK=SWIGLU_BLOCK)
    return dg, du


# ------------------------------------------------------------------------------------------------ CE chunk
@triton.jit
def _tanh(a):
    return 2.0 * tl.sigmoid(2.0 * a) - 1.0


@triton.jit
def _ce_chunk(z_ptr, z_stride, t_ptr, loss_ptr, scale_ptr, V: tl.constexpr, ignore_index, smoothing, cap,
              HAS_CAP: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    zrow = z_ptr + row * z_stride
    y = tl.load(t_ptr + row)
    if y == ignore_index:
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            tl.store(zrow + offs, tl.zeros((BLOCK_V,), dtype=tl.float32).to(z_ptr.dtype.element_ty), mask=offs < V)
        tl.store(loss_ptr + row, 0.0)
        return
    m = float("-inf")
    d = 0.0
    zsum = 0.0
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        z = tl.load(zrow + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_CAP:
            z = tl.where(mask, cap * _tanh(z / cap), float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        zsum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(d)
    z_y = tl.load(zrow + y).to(tl.float32)
    if HAS_CAP:
        z_y = cap * _tanh(z_y / cap)
    loss = lse - (1.0 - smoothing) * z_y - smoothing * (zsum / V)
    tl.store(loss_ptr + row, loss)
    scale = tl.load(scale_ptr)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        z = tl.load(zrow + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_CAP:
            t = _tanh(z / cap)
            z = cap * t
        g = tl.exp(z - lse) - smoothing / V
        g = tl.where(offs == y, g - (1.0 - smoothing), g)
        if HAS_CAP:
            g = g * (1.0 - t * t)
        tl.store(zrow + offs, (g * scale).to(z_ptr.dtype.element_ty), mask=mask)


def ce_chunk_grad(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int,
                  label_smoothing: float, softcap: float | None) -> torch.Tensor:
    """reference.ce_chunk_grad's contract: per-row loss (fp32), `logits` [n, V] (last dim contiguous)
    overwritten with the scaled gradient."""
    n, vocab = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        block = min(triton.next_power_of_2(vocab), 4096 if logits.is_cuda else 64)
        _ce_chunk[(n,)](logits, logits.stride(0), target, loss, scale, vocab, ignore_index, float(label_smoothing),
                        float(softcap or 1.0), HAS_CAP=softcap is not None, BLOCK_V=block,
                        num_warps=16 if block >= 4096 else 4)
    return loss
