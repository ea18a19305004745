"""The experts' products of a mixture-of-experts layer (`grouped_quantized_matmul` in `__init__.py`): one
Triton launch per matrix kind over the experts' stacked packed weights, in route order, the routes read
on the device (no host sync, so a MoE decode step can be captured in a CUDA graph). The K loop, dequant,
products and split-K reduction are `triton.py`'s `_split_k_body`, run per chosen expert over the routes'
rows. Imports triton; import lazily (`triton.py`'s Note on TRITON_INTERPRET holds here too)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lightspeed.ops.wquant.dequant import FORMAT_ID, INTERPRET
from lightspeed.ops.wquant.launch import counter, workspace
from lightspeed.ops.wquant.reference import FP6_FP16_SCALE, ROW_GROUP, QuantizedWeight
from lightspeed.ops.wquant.triton import _split_k_body, group_layout, reserve_scratch
from lightspeed.ops.wquant.tuning import (
    SPLIT_KS,
    TARGET_PROGRAMS_PER_SM,
    block_m_for,
    heuristic_config,
    max_split_k,
    num_sms,
)


@triton.jit
def _wq_grouped_kernel(x_ptr, w_ptr, w2_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, idx_ptr, R, N, stride_xm, out_scale,
                       expert_units, expert_bytes, experts, per_x, K: tl.constexpr, TILE: tl.constexpr,
                       SUB: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr, FORMAT: tl.constexpr,
                       PER_GROUP: tl.constexpr, X_BF16: tl.constexpr, BLOCK_M: tl.constexpr, INTERPRETED: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, ONE_DOT: tl.constexpr,
                       ROUTE_SLOTS: tl.constexpr):
    """The experts' products of a mixture-of-experts layer in one launch, in route order: out[r] = x[r //
    per_x] @ dequant(W_e).T with e = idx[r], for the R <= BLOCK_M routes r; W_e expert e's packed weight,
    expert_units (w units) / expert_bytes apart in the stacked planes, scales [experts, N, groups]. Routes
    to no expert (idx outside [0, experts)) are not written.
    Grid (N blocks, SPLIT_K, slots). ROUTE_SLOTS (fewer routes than experts): slot j serves the expert of
    route j unless an earlier route has it; else slot j serves expert j if a route has it. A slot's
    programs are `_split_k_body`'s (n, s) over all R rows, storing only its expert's, with that expert's
    counters; an idle slot returns at once, so only the routed experts' weights are read, and each once.
    The routes are read on the device: no host sync, so a decode step with MoE layers can be captured in
    a CUDA graph."""
    j = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    idx = tl.load(idx_ptr + offs_m, mask=offs_m < R, other=-1).to(tl.int32)
    if ROUTE_SLOTS:
        e = tl.sum(tl.where(offs_m == j, idx, 0))
        taken = tl.sum(((offs_m < j) & (idx == e)).to(tl.int32))
        busy = (e >= 0) & (e < experts) & (taken == 0)
    else:
        e = j
        busy = tl.sum((idx == e).to(tl.int32)) > 0
    # the body's runtime 1.0 from a float argument (never specialized): inside `if busy`, busy is known true,
    # and a 1.0 made from it folds (the wgmmas then stay in flight across the K loop: wrong int4 results)
    one = 1.0
    if not INTERPRETED:  # the interpreter passes out_scale as a Python float (and needs no guard)
        one = (out_scale != 0.0).to(tl.float32)
    if busy:
        NG: tl.constexpr = K // GROUP
        # the stride in w units too, not bytes // unit: triton then knows the 16-byte alignment of both
        # pointers (a division loses it, and with it the vector loads)
        _split_k_body(x_ptr, w_ptr + e.to(tl.int64) * expert_units, w2_ptr + e.to(tl.int64) * expert_bytes,
                      s_ptr + e.to(tl.int64) * N * NG, s_ptr, out_ptr, ws_ptr, cnt_ptr, R, offs_m, idx == e,
                      tl.minimum(offs_m, R - 1) // per_x, e * tl.num_programs(0), N, stride_xm, out_scale,
                      one, K, TILE, SUB, GROUP, SPG, FORMAT, PER_GROUP, False, X_BF16, BLOCK_M, 1,
                      INTERPRETED, ROWS, BLOCK_N, SPLIT_K, ONE_DOT)


def reserve_grouped_scratch(device: torch.device, fmt: str, N: int, experts: int) -> None:
    """`reserve_scratch` for `wq_grouped_matmul` over `experts` weights of N outputs: the same split-K
    partials bound, and a counter per (expert, N block) at BLOCK_N >= 64."""
    reserve_scratch(device, fmt, N)
    counter(device, experts * triton.cdiv(N, 64))


def grouped_config(R: int, N: int, K: int, experts: int, tile: int) -> dict:
    """The grouped kernel's config (not autotuned: which experts get rows is known only on the device):
    BLOCK_N 128 (64 for narrow N), 4 warps, 4 stages, one product per K-tile, and the split count (of
    `tuning.SPLIT_KS`, >= 2 K-tiles per split, <= `max_split_k(R)`) whose grid is nearest to
    `TARGET_PROGRAMS_PER_SM` programs per SM when min(experts, R) experts have rows (decode: each row
    routed to its own expert, the most weight bytes a call can read)."""
    if INTERPRET:
        return heuristic_config(R, K)
    block_n = 128 if N > 64 else 64
    busy = triton.cdiv(N, block_n) * min(experts, R)
    nt = triton.cdiv(K, tile)
    splits = [sk for sk in SPLIT_KS if sk == 1 or (sk <= max_split_k(R) and nt >= 2 * sk)]
    target = TARGET_PROGRAMS_PER_SM * num_sms()
    split_k = min(splits, key=lambda sk: (abs(math.log2(busy * sk / target)), sk))
    return {"BLOCK_N": block_n, "SPLIT_K": split_k, "ONE_DOT": 1, "STREAM": 0, "num_warps": 4, "num_stages": 4}


def wq_grouped_matmul(x: torch.Tensor, qw: QuantizedWeight, experts: torch.Tensor,
                      config: dict | None = None) -> torch.Tensor:
    """y [T * k, N] with y[t * k + i] = x[t] @ dequant(W_e).T, e = experts[t, i]: `qw` stacks E experts' [N, K]
    weights (planes [E, ...], scales [E, N, groups]); x [T, K] fp16/bf16; experts [T, k] integers on the
    device, T * k <= 64. Routes to no expert (outside [0, E)) give zero rows. One launch, no host sync
    (`_wq_grouped_kernel`). Callers validate (`lightspeed.ops.wquant.grouped_quantized_matmul`)."""
    T, K = x.shape
    per_x = experts.shape[1]
    R = T * per_x
    num_experts, N = qw.scales.shape[0], qw.shape[0]
    per_group, group, sub, spg = group_layout(qw.format, K, qw.group_size, qw.tile)
    cfg = dict(config) if config is not None else grouped_config(R, N, K, num_experts, qw.tile)
    block_n, split_k = cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K")
    cfg.pop("STREAM", None)
    out = torch.zeros((R, N), device=x.device, dtype=x.dtype)  # rows of dropped routes stay zero
    ws = workspace(x.device, split_k * R * N) if split_k > 1 else out
    cnt = counter(x.device, num_experts * triton.cdiv(N, block_n))
    packed = qw.planes[0]
    units = packed.view(torch.int32 if qw.format == "int8" else torch.int16)
    route_slots = R < num_experts
    _wq_grouped_kernel[(triton.cdiv(N, block_n), split_k, R if route_slots else num_experts)](
        x, units, packed, qw.scales, out, ws, cnt, experts, R, N, x.stride(0),
        FP6_FP16_SCALE if qw.format == "fp6" else 1.0, units[0].numel(), packed[0].numel(), num_experts, per_x, K=K,
        TILE=qw.tile, SUB=sub, GROUP=group, SPG=spg, FORMAT=FORMAT_ID[qw.format], PER_GROUP=per_group,
        X_BF16=x.dtype == torch.bfloat16, BLOCK_M=block_m_for(R), INTERPRETED=INTERPRET, ROWS=ROW_GROUP,
        BLOCK_N=block_n, SPLIT_K=split_k, ONE_DOT=cfg.pop("ONE_DOT", 1), ROUTE_SLOTS=route_slots, **cfg)
    return out
