"""`wq_matmul`, the host side of the weight-quantized matmul (`kernels.py` holds the kernels and their
design): the config (the tuner's pick, `tuning.py`, made once per class by `_tune`), scratch buffers and
launch plans (`launch.py`), and the prefill path. With `dequant.py` (the code -> weight tile bit tricks and
the prefill path's one-pass dequantizer), `kernels.py`, `tuning.py`, `ptx.py` (the inline dequant
routines), `launch.py` and `grouped.py` (a MoE layer's expert products), the only modules of ops/wquant
that import triton; import them lazily.

From DEQUANT_MIN_M[format] rows on `wq_matmul` dequantizes the weight once (`dequant.py`, one program per
storage chunk, bit-identical to the reference dequantizer) and multiplies with cuBLAS: the kernel
dequantizes each weight tile once per 64 rows, which from there on costs more than one dense copy of the
weight (H200, 8192 x 8192 and 8192 x 28672, M = 128..4096: the crossover is M ~ 256-512 for int8
(layout 5), 512 for fp6, 700-1000 for int4; BENCHMARKS.md, "Prefill: the kernel or dequantize once",
2026-11-29 and 2026-11-30).

Note: TRITON_INTERPRET. triton.jit reads TRITON_INTERPRET when the kernels are *defined*, i.e. when
`kernels.py` is first imported (by this module or `grouped.py`); the CPU tests set it before importing.
Under the interpreter the tuner is bypassed (its GPU timing is meaningless and slow there):
`heuristic_config` picks one valid config unless the caller passes `config=`; tl.dot runs in fp32 (the interpreter's
bf16 dot is wrong in triton 3.6) and the K loop is a while loop (no `range` over a runtime bound).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton.runtime.driver import driver

from lightspeed._utils.logging import get_logger
from lightspeed.ops.wquant.dequant import FORMAT_ID, INTERPRET, check_planes, dense_matmul, packed_units
from lightspeed.ops.wquant.kernels import _split_reduce_kernel, _wq_matmul_kernel
from lightspeed.ops.wquant.launch import Plan, counter, keep, plan_key, plans, workspace
from lightspeed.ops.wquant.reference import FP6_FP16_SCALE, ROW_GROUP, QuantizedWeight
from lightspeed.ops.wquant.tuning import (
    MAX_COPIES,
    MAX_SINGLE_BLOCK_M,
    MAX_STREAM_M,
    STREAMS,
    block_m_for,
    cached_pick,
    candidate_configs,
    describe,
    graph_bench,
    heuristic_config,
    max_split_k,
    num_sms,
    pick_fastest,
    refuse_capture,
    rotation_bench,
    rotation_copies,
    tune_m,
)

logger = get_logger(__name__)

_REDUCE_MODES = {"fixup": 1, "kernel": 0}
# from this M on (prefill), `wq_matmul` dequantizes the weight once and calls cuBLAS: the kernel
# dequantizes every weight tile once per 64 rows of x (crossovers measured on the H200: BENCHMARKS.md,
# "Prefill: the kernel or dequantize once", 2026-11-30)
DEQUANT_MIN_M = {"int8": 512, "fp6": 512, "int4": 1024}
REDUCE = _REDUCE_MODES.get(os.environ.get("LIGHTSPEED_WQ_REDUCE", "fixup"), 1)


def group_layout(fmt: str, K: int, group_size: int | None, tile: int) -> tuple[bool, int, int, int]:
    """(per_group, GROUP, SUB, SPG): the sub-tile width SUB (a field, tile/4 values; tile/8 for groups that
    are odd multiples of 16, which split each field in two) and SPG, how many consecutive sub-tiles share
    one scale (their dots are summed before one fp32 scale multiply)."""
    per_group = group_size is not None and group_size < K
    group = group_size if per_group else K
    sub = tile // 4 if group % (tile // 4) == 0 else tile // 8
    if not per_group:
        return False, group, sub, 1
    if group % sub:
        raise ValueError(f"group_size={group} must be a multiple of the {sub}-value sub-tile")
    if group % tile == 0:
        spg = tile // sub
    elif tile % group == 0:
        spg = group // sub
    else:
        spg = 1
    return True, group, sub, spg


def _stream_slots(N: int, block_n: int, programs: int) -> int:
    """Workspace slots of a stream-K launch: block b's partial from program q goes to slot b + q."""
    return triton.cdiv(N, block_n) + programs


_last_config: dict = {}
_tuned: dict = {}  # `_tune_key` -> the tuner's pick (config dict)
_last_timings: dict | None = None


def _scratch(M: int, N: int, sms: int) -> tuple[int, int]:
    """(fp32 workspace, int32 counters) that any autotuned candidate at M rows needs for N outputs: the
    largest split-K's partials, or stream-K's slots (BLOCK_N 128 at the most programs per SM), and a
    counter per program of any BLOCK_N >= 16."""
    block_m = block_m_for(M)
    stream = _stream_slots(N, 128, max(STREAMS) * sms) * block_m * 128 if M <= MAX_STREAM_M else 0
    split = max_split_k(M) * M * N if max_split_k(M) > 1 else 0  # SPLIT_K 1 writes y directly
    return max(split, stream, 1), triton.cdiv(N, 16) * triton.cdiv(M, block_m)


@functools.lru_cache(maxsize=None)
def scratch_numel(fmt: str, N: int, sms: int) -> tuple[int, int]:
    """`_scratch` at its largest over every M the kernel takes (below DEQUANT_MIN_M[fmt])."""
    sizes = [_scratch(M, N, sms) for M in range(1, DEQUANT_MIN_M[fmt])]
    return max(w for w, _ in sizes), max(c for _, c in sizes)


def reserve_scratch(device: torch.device, fmt: str, N: int) -> None:
    """Grow the device's split-K scratch buffers now to what a layer of N outputs can ask for, so that no
    call grows them: a layer's first call may run inside a CUDA graph capture or torch.compile's CUDA-graph
    warm-up, whose memory pool must not end up holding buffers that outlive the call."""
    with torch.cuda.device(device):
        ws, cnt = scratch_numel(fmt, N, num_sms())
    workspace(device, ws)
    counter(device, cnt)


def last_config() -> dict:
    """The config (BLOCK_M, BLOCK_N, SPLIT_K, ONE_DOT, STREAM, num_warps, num_stages) of the latest
    `wq_matmul` call."""
    return dict(_last_config)


def autotune_timings() -> dict | None:
    """{config: ms} of the latest tuning this process ran (None before any; a pick read from the disk
    cache is not timed)."""
    if not _last_timings:
        return None
    return {describe(dict(k)): t for k, t in _last_timings.items()}


def _tune_key(x: torch.Tensor, qw: QuantizedWeight, red: int) -> tuple:
    """What a tuning is valid for: the device, M's bucket (`tune_m`), the weight's shape and format, x's
    dtype and the split-K reduction (not the pointers: one pick serves every weight of the shape)."""
    return (driver.active.get_current_device(), tune_m(x.shape[0]), qw.shape, qw.format, qw.group_size, qw.tile,
            x.dtype, red)


def _weight_copies(qw: QuantizedWeight) -> list[QuantizedWeight] | None:
    """The weight and enough temporary copies for `rotation_bench` (`tuning.rotation_copies`: none for a
    weight of >= 2 x L2 bytes, < 2 x L2 bytes of copies otherwise); None when it would take more than
    MAX_COPIES, or when they do not fit in memory (logged)."""
    count = rotation_copies(qw.num_bytes)
    if count > MAX_COPIES:
        return None
    try:
        return [qw] + [QuantizedWeight(qw.format, qw.shape, qw.group_size, tuple(p.clone() for p in qw.planes),
                                       qw.scales.clone(), qw.dtype, qw.tile) for _ in range(count - 1)]
    except torch.OutOfMemoryError:
        logger.warning("quantized matmul: no memory for %d copies of a %s weight to tune with; timing one weight "
                       "after an L2 flush", count - 1, tuple(qw.shape))
        return None


def _tune(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, red: int) -> dict:
    """The fastest of `candidate_configs` for this call's class (`tuning.pick_fastest`), timed on this
    call's x over rotated copies of its weight (`tuning.rotation_bench`; small weights, or copies that do
    not fit in memory: on the weight alone after an L2 flush, `graph_bench`), or read from the disk cache
    (`tuning.cached_pick`)."""
    global _last_timings
    _last_timings = None  # `autotune_timings`: a pick read from the disk cache was not timed here
    M, K = x.shape
    N = qw.shape[0]
    candidates = candidate_configs(M, N, K, qw.tile, num_sms())
    ws_numel = _scratch(M, N, num_sms())[0]
    what = f"quantized matmul {M} x {K} -> {N} ({qw.format})"

    def tune() -> tuple[dict, dict]:
        global _last_timings
        refuse_capture()  # before allocating copies in a caller's graph pool
        copies = _weight_copies(qw)
        if copies is None:
            def bench(cfg):
                return graph_bench(lambda: _launch(x, qw, bias, cfg, red, ws_numel))
        else:
            def bench(cfg):
                return rotation_bench(lambda i: _launch(x, copies[i], bias, cfg, red, ws_numel), len(copies))
        best, _last_timings = pick_fastest(candidates, bench, what)
        logger.info("%s: tuned %s (%.1f us of %d candidates)", what, describe(best),
                    _last_timings[tuple(best.items())] * 1e3, len(candidates))
        return best, _last_timings

    return cached_pick(_wq_matmul_kernel, _tune_key(x, qw, red)[1:], candidates, tune)


def _launch(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, cfg: dict, red: int, ws_numel: int):
    """One call of the kernel with config `cfg` (and, for the two-kernel reduction, its reduce kernel):
    (y, the compiled kernel, grid, positional arguments, constexprs). ws_numel: the split-K / stream-K
    workspace to ask for (0: none, y stands in)."""
    M, K = x.shape
    N = qw.shape[0]
    per_group, group, sub, spg = group_layout(qw.format, K, qw.group_size, qw.tile)
    packed = qw.planes[0]
    w = packed_units(qw)  # int8: 32-bit words; 4-bit plane: half-words (layout Note)
    scales = qw.scales.contiguous()
    block_m = block_m_for(M)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    has_bias = bias is not None
    b = bias if has_bias else scales  # dummy pointer when HAS_BIAS is False
    sms = 1 if INTERPRET else num_sms()  # the interpreter: STREAM programs in all
    ws = workspace(x.device, ws_numel) if ws_numel else out
    cnt = counter(x.device, _scratch(M, N, sms)[1])
    block_n, split_k, stream = cfg["BLOCK_N"], cfg["SPLIT_K"], cfg["STREAM"]
    if stream:  # stream-K: STREAM programs per SM, each >= 1 unit
        grid = (min(triton.cdiv(N, block_n) * triton.cdiv(K, qw.tile), stream * sms), 1, 1)
    else:
        grid = (triton.cdiv(N, block_n), split_k, triton.cdiv(M, block_m))
    pos = (x, w, packed, scales, b, out, ws, cnt, M, N, x.stride(0), FP6_FP16_SCALE if qw.format == "fp6" else 1.0,
           tune_m(M))
    consts = dict(K=K, TILE=qw.tile, SUB=sub, GROUP=group, SPG=spg, FORMAT=FORMAT_ID[qw.format], PER_GROUP=per_group,
                  HAS_BIAS=has_bias, X_BF16=x.dtype == torch.bfloat16, BLOCK_M=block_m, REDUCE=red,
                  INTERPRETED=INTERPRET, ROWS=ROW_GROUP, BLOCK_N=block_n, SPLIT_K=split_k, ONE_DOT=cfg["ONE_DOT"],
                  STREAM=stream)
    compiled = _wq_matmul_kernel[grid](*pos, **consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split_k > 1 and red == 0 and not stream:
        numel = M * N
        block = 1024
        _split_reduce_kernel[(triton.cdiv(numel, block),)](ws, b, out, numel, N, SPLIT_K=split_k, HAS_BIAS=has_bias,
                                                          BLOCK=block)
    return out, compiled, grid, pos, consts


def wq_matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None,
              config: dict | None = None, reduce: str | None = None) -> torch.Tensor:
    """y = x @ dequant(W).T (+ bias). x: [M, K] fp16/bf16 contiguous along K, on the weight's device;
    y: [M, N] in x's dtype. M >= DEQUANT_MIN_M[format] (without `config`): `dequantize_weight` + torch.matmul.
    `config` (BLOCK_N, SPLIT_K, ONE_DOT, STREAM, num_warps, num_stages) skips the tuner;
    `reduce` ("fixup" | "kernel") overrides the split-K reduction. Callers validate shapes and dtypes
    (see `lightspeed.ops.wquant.quantized_matmul`); the planes must be contiguous as packed.

    On the GPU the first call of each `_tune_key` class picks its config (`_tune`), unless `config` is
    given; a first call inside a CUDA-graph capture raises (make one before capturing). Later calls of a
    (shapes, M, dtypes, alignment) class launch the compiled kernel of its first tuned call directly
    (`launch.py`'s Note: launch plans); not `config=` / `reduce=` calls, the interpreter, the
    dequantize-once path or the two-kernel reduction."""
    global _last_config
    planned = config is None and reduce is None and not INTERPRET and REDUCE == 1
    if planned:
        key = plan_key(x, qw, bias, REDUCE)
        plan = plans.get(key)
        if plan is not None:
            _last_config = plan.config
            return plan.launch(x, qw, bias)
    M, K = x.shape
    N = qw.shape[0]
    check_planes(qw)
    if config is None and M >= DEQUANT_MIN_M[qw.format]:  # prefill: dequantize once, then dense cuBLAS products
        _last_config = {"PATH": "dequant+matmul"}
        return dense_matmul(x, qw, bias)
    red = REDUCE if reduce is None else _REDUCE_MODES[reduce]
    sms = 1 if INTERPRET else num_sms()
    if config is None and not INTERPRET:
        tkey = _tune_key(x, qw, red)
        cfg = _tuned.get(tkey)
        if cfg is None:
            cfg = _tuned[tkey] = _tune(x, qw, bias, red)
        ws_numel = _scratch(M, N, sms)[0]  # every candidate's: no growth between tunings
    else:
        cfg = {"ONE_DOT": 1, "STREAM": 0, "num_warps": 4, "num_stages": 3,
               **(dict(config) if config is not None else heuristic_config(M, K))}
        if cfg["SPLIT_K"] > 1 and M > MAX_SINGLE_BLOCK_M:
            raise ValueError(f"SPLIT_K > 1 needs M <= {MAX_SINGLE_BLOCK_M} (got M={M})")
        if cfg["STREAM"] and M > MAX_STREAM_M:  # tuning.MAX_STREAM_M: wrong results seen above
            raise ValueError(f"STREAM needs M <= {MAX_STREAM_M} (got M={M})")
        if cfg["STREAM"]:
            ws_numel = _stream_slots(N, cfg["BLOCK_N"], cfg["STREAM"] * sms) * block_m_for(M) * cfg["BLOCK_N"]
        else:
            ws_numel = cfg["SPLIT_K"] * M * N if cfg["SPLIT_K"] > 1 else 0
    out, compiled, grid, pos, consts = _launch(x, qw, bias, cfg, red, ws_numel)
    _last_config = {"BLOCK_M": block_m_for(M), **{k: cfg[k] for k in _CONFIG_KEYS}}
    if planned and qw.scales.is_contiguous() and (bias is None or bias.is_contiguous()):
        named = {**dict(zip(_wq_matmul_kernel.arg_names, pos)), **consts}
        keep(key, Plan(compiled, grid, [named[a] for a in _wq_matmul_kernel.arg_names], _last_config))
    return out


_CONFIG_KEYS = ("BLOCK_N", "SPLIT_K", "ONE_DOT", "STREAM", "num_warps", "num_stages")
