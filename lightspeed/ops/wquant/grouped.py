"""The experts' products of a mixture-of-experts layer (`grouped_quantized_matmul` in `__init__.py`): one
Triton launch per matrix kind over the experts' stacked packed weights, in route order, the routes read
on the device (no host sync, so a MoE decode step can be captured in a CUDA graph). The K loop, dequant,
products and split-K reduction are `kernels.py`'s `_split_k_body`, run per chosen expert over the routes'
rows. Imports triton; import lazily (`triton.py`'s Note on TRITON_INTERPRET holds here too)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.driver import driver

from lightspeed._utils.logging import get_logger
from lightspeed.ops.wquant.dequant import FORMAT_ID, INTERPRET
from lightspeed.ops.wquant.kernels import _split_k_body
from lightspeed.ops.wquant.launch import Plan, counter, keep, plans, workspace
from lightspeed.ops.wquant.reference import FP6_FP16_SCALE, ROW_GROUP, QuantizedWeight
from lightspeed.ops.wquant.triton import group_layout, reserve_scratch
from lightspeed.ops.wquant.tuning import (
    MAX_COPIES,
    TARGET_PROGRAMS_PER_SM,
    block_m_for,
    cached_pick,
    describe,
    heuristic_config,
    make_config,
    num_sms,
    pick_fastest,
    refuse_capture,
    rotation_bench,
    rotation_copies,
    usable_splits,
)

logger = get_logger(__name__)


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
                      tl.where(idx == e, offs_m // per_x, -1), e * tl.num_programs(0), N, stride_xm, out_scale,
                      one, K, TILE, SUB, GROUP, SPG, FORMAT, PER_GROUP, False, X_BF16, BLOCK_M, 1,
                      INTERPRETED, ROWS, BLOCK_N, SPLIT_K, ONE_DOT)


def reserve_grouped_scratch(device: torch.device, fmt: str, N: int, experts: int) -> None:
    """`reserve_scratch` for `wq_grouped_matmul` over `experts` weights of N outputs: the same split-K
    partials bound, and a counter per (expert, N block) at BLOCK_N >= 64."""
    reserve_scratch(device, fmt, N)
    counter(device, experts * triton.cdiv(N, 64))


def grouped_config(R: int, N: int, K: int, experts: int, tile: int) -> dict:
    """The grouped kernel's untuned config: the interpreter's, and the one a call made inside a CUDA-graph
    capture before its class was tuned uses (`wq_grouped_matmul`): BLOCK_N 128 (64 for narrow N), 4
    warps, 4 stages, one product per K-tile, and the split count (of `GROUPED_SPLIT_KS`, >= 2 K-tiles per
    split, <= `max_split_k(R)`) whose grid is nearest to `TARGET_PROGRAMS_PER_SM` programs per SM when
    min(experts, R) experts have rows."""
    if INTERPRET:
        return heuristic_config(R, K)
    block_n = 128 if N > 64 else 64
    busy = triton.cdiv(N, block_n) * min(experts, R)
    target = TARGET_PROGRAMS_PER_SM * num_sms()
    splits = usable_splits(GROUPED_SPLIT_KS, R, triton.cdiv(K, tile))
    split_k = min(splits, key=lambda sk: (abs(math.log2(busy * sk / target)), sk))
    return make_config(block_n, split_k, 4, 4, 1)


# split counts the grouped kernel is tuned over: 3 too (H200, Mixtral's experts: the best split of each
# (matrix, tokens, format) cell was 1, 2, 3, 4, 6 or 8; docs/benchmark-notes/moe.md, "Tuned per class",
# 2026-11-30)
GROUPED_SPLIT_KS = (1, 2, 3, 4, 6, 8)


def grouped_candidates(R: int, N: int, K: int, tile: int) -> list[dict]:
    """The configs `wq_grouped_matmul` times on a class's first call: BLOCK_N 128 (64 for narrow N), 4 warps,
    one product per K-tile, every split of `GROUPED_SPLIT_KS` that gives each split >= 2 K-tiles and keeps
    the workspace within `max_split_k(R)`, 3 and 4 stages (<= 12)."""
    block_n = 128 if N > 64 else 64
    return [make_config(block_n, sk, 4, st, 1) for sk in usable_splits(GROUPED_SPLIT_KS, R, triton.cdiv(K, tile))
            for st in (3, 4)]


_tuned: dict = {}  # tune key -> the fastest of `grouped_candidates` (config dict)


def _tune_key(x: torch.Tensor, qw: QuantizedWeight, experts: torch.Tensor) -> tuple:
    return (driver.active.get_current_device(), x.dtype, tuple(experts.shape), qw.format, qw.shape, qw.group_size,
            qw.tile, qw.scales.shape[0])


def rotated_routes(experts: torch.Tensor, num_experts: int, bytes_per_expert: int) -> list[torch.Tensor]:
    """The routes `rotation_bench` cycles over while tuning: `experts` and copies of it sending each
    route to other experts, one to one, so that consecutive calls read other experts' weights (as other
    layers' would) and none is in L2 (`tuning.rotation_copies`); as many as there are disjoint sets of
    the routed experts' size (<= num_experts // routed) and MAX_COPIES. Routes to no expert are kept."""
    valid = (experts >= 0) & (experts < num_experts)
    routed = torch.unique(experts[valid]).tolist()  # host sync: tuning only
    if not routed:
        return [experts]
    d = len(routed)
    order = routed + [e for e in range(num_experts) if e not in set(routed)]
    copies = min(rotation_copies(d * bytes_per_expert), num_experts // d, MAX_COPIES)
    out = []
    for i in range(copies):
        table = torch.arange(num_experts, device=experts.device, dtype=experts.dtype)
        table[routed] = torch.tensor(order[i * d:(i + 1) * d], device=experts.device, dtype=experts.dtype)
        out.append(torch.where(valid, table[experts.clamp(0, num_experts - 1).long()], experts).contiguous())
    return out


def _tune(x: torch.Tensor, qw: QuantizedWeight, experts: torch.Tensor) -> dict:
    """The fastest candidate for this call's class (`tuning.pick_fastest`), timed on this call's inputs with
    its routes rotated over other experts (`rotated_routes`, `tuning.rotation_bench`; which experts the
    routes hit is known only on the device, so this call's routes stand for the class's), or read from the
    disk cache (`tuning.cached_pick`)."""
    K = x.shape[1]
    R, N = experts.numel(), qw.shape[0]
    num_experts = qw.scales.shape[0]
    what = f"grouped_quantized_matmul: {R} routes of {N} x {K} {qw.format} experts"
    candidates = grouped_candidates(R, N, K, qw.tile)

    def tune() -> tuple[dict, dict]:
        refuse_capture()  # `wq_grouped_matmul` does not tune inside a capture; a guard for other callers
        routes = rotated_routes(experts, num_experts, qw.num_bytes // num_experts)

        def bench(cfg):
            return rotation_bench(lambda i: _launch(x, qw, routes[i], cfg), len(routes))

        best, timings = pick_fastest(candidates, bench, what)
        logger.info("%s: %s (%.1f us)", what, describe(best), timings[tuple(best.items())] * 1e3)
        return best, timings

    return cached_pick(_wq_grouped_kernel, _tune_key(x, qw, experts)[1:], candidates, tune)


def grouped_plan_key(x: torch.Tensor, qw: QuantizedWeight, experts: torch.Tensor) -> tuple:
    """What a grouped launch plan depends on besides the tensors' addresses (as `launch.plan_key`): the
    shapes, the routes' shape and dtype, x's row stride, the dtypes and the 16-byte alignment of every
    pointer."""
    w, s = qw.planes[0], qw.scales
    return ("grouped", driver.active.get_current_device(), x.dtype, tuple(x.shape), x.stride(0), x.data_ptr() % 16,
            qw.format, qw.shape, qw.group_size, qw.tile, tuple(w.shape), w.dtype, w.data_ptr() % 16, tuple(s.shape),
            s.dtype, s.data_ptr() % 16, tuple(experts.shape), experts.dtype, experts.data_ptr() % 16)


# the arguments each planned call sets: x, the w units, fp6's lo bytes, scales, out, (ws: out at SPLIT_K 1), idx
_PER_CALL = (0, 1, 2, 3, 4, 7)


def wq_grouped_matmul(x: torch.Tensor, qw: QuantizedWeight, experts: torch.Tensor,
                      config: dict | None = None) -> torch.Tensor:
    """y [T * k, N] with y[t * k + i] = x[t] @ dequant(W_e).T, e = experts[t, i]: `qw` stacks E experts' [N, K]
    weights (planes [E, ...], scales [E, N, groups], contiguous); x [T, K] fp16/bf16 contiguous along K;
    experts [T, k] contiguous integers on the device, T * k <= 64. Routes to no expert (outside [0, E)) give
    zero rows. One launch, no host sync (`_wq_grouped_kernel`). Callers validate
    (`lightspeed.ops.wquant.grouped_quantized_matmul`). Later calls of a `grouped_plan_key` class launch the
    first call's compiled kernel directly (`launch.py`'s Note: launch plans), unless `config` is given.
    Without `config` each (routes' shape, weight) class is tuned on its first call (`_tune`)."""
    K = x.shape[1]
    R = experts.numel()
    num_experts, N = qw.scales.shape[0], qw.shape[0]
    planned = config is None and not INTERPRET
    if planned:
        key = grouped_plan_key(x, qw, experts)
        plan = plans.get(key)
        if plan is not None:
            out = torch.zeros((R, N), device=x.device, dtype=x.dtype)
            args = plan.args.copy()
            w = qw.planes[0].data_ptr()
            args[0:5] = (x.data_ptr(), w, w, qw.scales.data_ptr(), out.data_ptr())
            if plan.config["SPLIT_K"] == 1:
                args[5] = args[4]
            args[7] = experts.data_ptr()
            plan.run(args)
            return out
    if config is not None:
        cfg = dict(config)
    elif INTERPRET:
        cfg = grouped_config(R, N, K, num_experts, qw.tile)
    else:
        cfg = _tuned.get(_tune_key(x, qw, experts))
        if cfg is None and torch.cuda.is_current_stream_capturing():  # timing cannot run inside a capture
            cfg, planned = grouped_config(R, N, K, num_experts, qw.tile), False
            _log_untuned(R, N, K, qw.format)
        elif cfg is None:
            cfg = _tuned[_tune_key(x, qw, experts)] = _tune(x, qw, experts)
    out, compiled, grid, pos, consts = _launch(x, qw, experts, cfg)
    if planned:
        named = {**dict(zip(_wq_grouped_kernel.arg_names, pos)), **consts}
        keep(key, Plan(compiled, grid, [named[a] for a in _wq_grouped_kernel.arg_names], dict(cfg)),
             _PER_CALL + ((5,) if cfg["SPLIT_K"] == 1 else ()))
    return out


_untuned_logged: set = set()


def _log_untuned(R: int, N: int, K: int, fmt: str) -> None:
    if (R, N, K, fmt) not in _untuned_logged:
        _untuned_logged.add((R, N, K, fmt))
        logger.info("grouped_quantized_matmul: first call for %d routes of %d x %d %s experts inside a CUDA-graph "
                    "capture: untuned config (a call with the same shapes before capturing tunes it)", R, N, K, fmt)


def _launch(x: torch.Tensor, qw: QuantizedWeight, experts: torch.Tensor, cfg: dict):
    """One launch of the grouped kernel with config `cfg`: (y, the compiled kernel, grid, positional
    arguments, constexprs)."""
    T, K = x.shape
    per_x = experts.shape[1]
    R = T * per_x
    num_experts, N = qw.scales.shape[0], qw.shape[0]
    per_group, group, sub, spg = group_layout(qw.format, K, qw.group_size, qw.tile)
    cfg = dict(cfg)
    block_n, split_k = cfg.pop("BLOCK_N"), cfg.pop("SPLIT_K")
    cfg.pop("STREAM", None)
    out = torch.zeros((R, N), device=x.device, dtype=x.dtype)  # rows of dropped routes stay zero
    ws = workspace(x.device, split_k * R * N) if split_k > 1 else out
    cnt = counter(x.device, num_experts * triton.cdiv(N, block_n))
    packed = qw.planes[0]
    units = packed.view(torch.int32 if qw.format == "int8" else torch.int16)
    route_slots = R < num_experts
    grid = (triton.cdiv(N, block_n), split_k, R if route_slots else num_experts)
    pos = (x, units, packed, qw.scales, out, ws, cnt, experts, R, N, x.stride(0),
           FP6_FP16_SCALE if qw.format == "fp6" else 1.0, units[0].numel(), packed[0].numel(), num_experts, per_x)
    consts = dict(K=K, TILE=qw.tile, SUB=sub, GROUP=group, SPG=spg, FORMAT=FORMAT_ID[qw.format], PER_GROUP=per_group,
                  X_BF16=x.dtype == torch.bfloat16, BLOCK_M=block_m_for(R), INTERPRETED=INTERPRET, ROWS=ROW_GROUP,
                  BLOCK_N=block_n, SPLIT_K=split_k, ONE_DOT=cfg.pop("ONE_DOT", 1), ROUTE_SLOTS=route_slots)
    compiled = _wq_grouped_kernel[grid](*pos, **consts, **cfg)
    return out, compiled, grid, pos, consts
