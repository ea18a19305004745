"""Autotuning of the weight-quantized matmul kernel (`triton.py`): the config space, the <= 18
candidates timed per problem, the autotuner's timer (`graph_bench`), the interpreter's fixed config, and
the M blocking. Imports triton (for `triton.Config`); like `triton.py`, import it lazily."""

from __future__ import annotations

import math

import torch
import triton

MAX_SINGLE_BLOCK_M = 64  # up to here, one M block (decode); above, a grid over M blocks of 64
_NUM_SMS = None


def make_config(block_n, split_k, num_warps, num_stages, one_dot=1, stream=0):
    return triton.Config({"BLOCK_N": block_n, "SPLIT_K": split_k, "ONE_DOT": one_dot, "STREAM": stream},
                         num_warps=num_warps, num_stages=num_stages)


BLOCK_NS = (64, 128)  # >= 64: the swapped product's wgmma (triton.py's module docstring)
# 6: one wave of <= 3 programs per SM for 64 N blocks (8192- and 28672 x 8192-wide K x 8192 at BLOCK_N 128:
# 384 programs; H200, session 15: int4 28672 x 8192 M = 4 / 16 35.7 / 36.8 -> 34.0 / 34.6 us)
SPLIT_KS = (1, 2, 4, 6, 8, 16)
_STAGES_WARPS = ((4, 3), (4, 4), (8, 3), (8, 4))  # 8 warps when M > 16 at BLOCK_N 128
STREAMS = (2, 3)  # stream-K programs per SM (triton.py `_stream_k_body`), BLOCK_N 128, 4 stages
MAX_STREAM_M = 16  # stream-K only up to here: fp6 at M = 32 (K 28672, 8 warps, one product per K-tile) gave
# wrong results on the H200 with layouts 4-5 (all but one N block zero, every call). Not reproduced at layout 7
# (0 of 6 calls wrong for 4 configs, BENCHMARKS.md session 8), but its cause was never found: the limit stays
CONFIGS = [make_config(bn, sk, w, s, od) for bn in BLOCK_NS for sk in SPLIT_KS for w, s in _STAGES_WARPS
           for od in (0, 1)]
CONFIGS += [make_config(128, 1, 4, 4, od, st) for st in STREAMS for od in (0, 1)]
TARGET_PROGRAMS_PER_SM = 3  # H200 sweep (2026-11-29): the best split gave 2-7 programs per SM


def num_sms() -> int:
    global _NUM_SMS
    if _NUM_SMS is None:
        _NUM_SMS = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return _NUM_SMS


def num_k_tiles(K: int, tile: int) -> int:
    return -(-K // tile)


def candidate_configs(M: int, N: int, K: int, tile: int, sms: int) -> list[triton.Config]:
    """The configs the autotuner times for one problem (<= 9, each for both product forms ONE_DOT 1 / 0):
    at BLOCK_N 128 the three SPLIT_Ks whose
    program counts are nearest TARGET_PROGRAMS_PER_SM * sms (log scale; every split >= 2 K-tiles, at
    most `max_split_k(M)`), each with 3 and 4 stages; at BLOCK_N 64 the nearest one with 3 stages;
    for M <= MAX_STREAM_M stream-K at BLOCK_N 128 with 2 and 3 programs per SM (4 stages) when every
    program gets >= 2 units.
    4 warps, 8 at BLOCK_N 128 when M > 16 (fp6 at M = 32 over 4 warps: 200 registers per thread, at M = 64
    a spill)."""
    nt = num_k_tiles(K, tile)
    m_blocks = -(-M // MAX_SINGLE_BLOCK_M) if M > MAX_SINGLE_BLOCK_M else 1
    target = TARGET_PROGRAMS_PER_SM * sms
    splits = [sk for sk in SPLIT_KS if sk == 1 or (sk <= max_split_k(M) and nt >= 2 * sk)]
    out = []
    for bn in BLOCK_NS:
        if bn == 128 and N <= 64:
            continue  # mostly padding
        ranked = sorted(splits, key=lambda sk: (abs(math.log2(-(-N // bn) * sk * m_blocks / target)), sk))
        warps = 8 if M > 16 and bn == 128 else 4
        stages = (3, 4) if bn == 128 else (3,)
        one_dots = (1, 0)
        out += [make_config(bn, sk, warps, st, od) for sk in ranked[:3 if bn == 128 else 1] for st in stages
                for od in one_dots]
        if bn == 128 and M <= MAX_STREAM_M:
            out += [make_config(bn, 1, warps, 4, od, st) for st in STREAMS if st * sms * 2 <= -(-N // bn) * nt
                    for od in one_dots]
    return _dedup(out)


def _dedup(configs: list) -> list:
    seen, out = set(), []
    for c in configs:
        key = config_key(c)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def prune_configs(configs, named_args, **kwargs):
    """The autotuner's early prune: the configs `candidate_configs` picks for this call."""
    wanted = {config_key(c) for c in candidate_configs(named_args["M"], named_args["N"], kwargs["K"],
                                                       kwargs["TILE"], num_sms())}
    return [c for c in configs if config_key(c) in wanted]


def config_dict(c) -> dict:
    """A `triton.Config` as the `config=` dict `wq_matmul` takes (its kwargs plus warps and stages)."""
    return {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}


def config_key(c) -> tuple:
    return (c.kwargs["BLOCK_N"], c.kwargs["SPLIT_K"], c.kwargs["ONE_DOT"], c.kwargs["STREAM"], c.num_warps,
            c.num_stages)


def heuristic_config(M: int, K: int) -> dict:
    """One valid config for the interpreter (small tiles so tests exercise masking and several tiles)."""
    return {"BLOCK_N": 32, "SPLIT_K": 1, "ONE_DOT": 1, "STREAM": 0, "num_warps": 4, "num_stages": 2}


def block_m_for(M: int) -> int:
    """M padded for tl.dot: 16, 32 or 64; larger M is tiled in blocks of 64."""
    return 16 if M <= 16 else 32 if M <= 32 else 64


def tune_m(M: int) -> int:
    """The M the autotuner keys on: M itself up to MAX_SINGLE_BLOCK_M (decode: the best split differs
    between neighbouring M), above it the next power of two, so prefill prompts of new lengths reuse their
    bucket's tuning instead of timing every candidate again (about 0.3 s per layer shape). Above 64 rows
    the candidates are the same for every M (SPLIT_K 1, 8 warps at BLOCK_N 128)."""
    return M if M <= MAX_SINGLE_BLOCK_M else 1 << (M - 1).bit_length()


def max_split_k(M: int) -> int:
    """Split-K bound by M, which also bounds the workspace to 256 * N fp32 values."""
    return 16 if M <= 16 else 8 if M <= 32 else 4 if M <= MAX_SINGLE_BLOCK_M else 1


# `graph_bench`: calls per CUDA graph (about GRAPH_MS of GPU time each) and graph replays per timing
GRAPH_MS = 2.0
GRAPH_REPLAYS = 5


def _replay_ms(graph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def graph_bench(kernel_call, quantiles=None):
    """The autotuner's timer (ms per call): one CUDA graph of n x (L2 flush, call) minus one of n x flush,
    medians over replays. Triton's default (events around single calls after zeroing a buffer larger
    than L2: dirty lines the kernel's reads must write back, and no back-to-back launches) picked configs
    14% slower on average (worst 41%) than the fastest candidate in `benchmarks/fp6_gemm.py`'s timing
    on the H200; this timer's picks 1.1% (worst 6.9%), over 12 (shape, format, M) cells
    (`benchmarks/wq_autotune.py`, BENCHMARKS.md)."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the quantized matmul autotunes on its first call for each (M, N, K, format) and "
                           "cannot do so inside CUDA-graph capture: make one call with the same shapes "
                           "before capturing (a warm-up step)")
    # the flush: a read of 2 x L2, which evicts the weight and leaves only clean lines, as the other
    # layers' weight reads before a decode step's matmul do (allocated per call: no memory kept after tuning)
    flush = torch.zeros(2 * torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size // 4,
                        device="cuda", dtype=torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel_call()  # compiles on first use
        flush.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            flush.sum()
            kernel_call()
        end.record()
        end.synchronize()
        n = max(4, min(100, int(GRAPH_MS * 3 / max(start.elapsed_time(end), 1e-3))))
        graphs = []
        for with_call in (False, True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(n):
                    flush.sum()
                    if with_call:
                        kernel_call()
            graphs.append(graph)
        times = ([], [])
        for _ in range(GRAPH_REPLAYS):  # interleaved: clock drift hits both alike
            for i, graph in enumerate(graphs):
                times[i].append(_replay_ms(graph))
    torch.cuda.current_stream().wait_stream(stream)
    ms = max((sorted(times[1])[GRAPH_REPLAYS // 2] - sorted(times[0])[GRAPH_REPLAYS // 2]) / n, 1e-6)
    return [ms] * len(quantiles) if quantiles else ms
