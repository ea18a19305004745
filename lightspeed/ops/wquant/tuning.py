"""Autotuning of the weight-quantized kernels (`triton.py`, `grouped.py`): the config space, the <= 20
candidates timed per problem, the timer (`rotation_bench`; `graph_bench` where copies do not fit), the
pick (`pick_fastest`) and its disk cache (`cached_pick`), the interpreter's fixed config, and the M
blocking. Imports triton; like `triton.py`, import it lazily.

Note: the tuner's timer (v3). A decode step runs each layer's matmul right after other layers' kernels
that read other weights, so a call finds none of its weight in L2 and follows another kernel back to
back. `rotation_bench` times exactly that: a CUDA graph of back-to-back calls cycling over enough
different weights (`rotation_copies`: >= 2 x L2 bytes per cycle; temporary copies of the weight, or for
the experts' kernel other experts) that none is in L2. Timer v2 (`graph_bench`: one weight, an L2
flush kernel before each call) ranked the candidates differently: on the H200 it favoured split-K 4 over
stream-K by 1-2 us (int4 8192 x 28672, M = 4 / 8: its pick 3-4% slower than the fastest candidate in
some processes), while two weights alternating back to back ranked them as fp6_gemm.py's benchmark
(four rotated copies) does (docs/benchmark-notes/quantized-gemm-tuning.md, "Timer v3",
2026-11-30). Weights that would need more than MAX_COPIES
copies are still timed by `graph_bench`. Candidates within `REFINE` of the fastest are
timed a second time and ranked by the mean of both, because picks between candidates that close
otherwise follow the noise."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable

import torch
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources, PTXASError

from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)

MAX_SINGLE_BLOCK_M = 64  # up to here, one M block (decode); above, a grid over M blocks of 64
_NUM_SMS = None


def make_config(block_n, split_k, num_warps, num_stages, one_dot=1, stream=0) -> dict:
    """A kernel config as `wq_matmul`'s `config=` takes it (and the tuner times and caches it)."""
    return {"BLOCK_N": block_n, "SPLIT_K": split_k, "ONE_DOT": one_dot, "STREAM": stream, "num_warps": num_warps,
            "num_stages": num_stages}


BLOCK_NS = (64, 128)  # >= 64: the swapped product's wgmma (kernels.py's module docstring)
# 6: one wave of <= 3 programs per SM for 64 N blocks (8192- and 28672 x 8192-wide K x 8192 at BLOCK_N 128:
# 384 programs; H200: int4 28672 x 8192 M = 4 / 16 35.7 / 36.8 -> 34.0 / 34.6 us,
# docs/benchmark-notes/quantized-gemm-tuning.md, "Split-K 6", 2026-11-30)
SPLIT_KS = (1, 2, 4, 6, 8, 16)
STREAMS = (2, 3)  # stream-K programs per SM (kernels.py `_stream_k_body`), BLOCK_N 128, 4 stages
MAX_STREAM_M = 16  # stream-K only up to here: fp6 at M = 32 (K 28672, 8 warps, one product per K-tile) gave
# wrong results on the H200 with layouts 4-5 (all but one N block zero, every call). Not reproduced at layout 7
# (0 of 6 calls wrong for 4 configs; docs/benchmark-notes/quantized-gemm-correctness.md, 2026-11-30), but its
# cause was never found: the limit stays

# BLOCK_N 64 at SPLIT_K 3 (outside SPLIT_KS, one product per K-tile) is a candidate for M <= 16: the fastest
# config at M = 16 for fp6 8192 x 8192 and 8192 x 28672 on the H200 (16.8 / 50.9 us against the candidates'
# 17.6 / 53.1), 5-10 programs per SM; with the padding rows' x loads masked also at M = 2..8 on fp6 8192 x 8192
# (16.45-16.59 us against 16.72-17.02; docs/benchmark-notes/quantized-gemm-tuning.md, "BLOCK_N 64 at split-K 3",
# 2026-11-30)
BN64_SPLIT3_MAX_M = 16
TARGET_PROGRAMS_PER_SM = 3  # H200 sweep (2026-11-29): the best split gave 2-7 programs per SM


def num_sms() -> int:
    global _NUM_SMS
    if _NUM_SMS is None:
        _NUM_SMS = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return _NUM_SMS


def num_k_tiles(K: int, tile: int) -> int:
    return -(-K // tile)


def candidate_configs(M: int, N: int, K: int, tile: int, sms: int) -> list[dict]:
    """The configs the tuner times for one problem (<= 20; most for both product forms ONE_DOT 1 / 0):
    at BLOCK_N 128 the three SPLIT_Ks whose
    program counts are nearest TARGET_PROGRAMS_PER_SM * sms (log scale; every split >= 2 K-tiles, at
    most `max_split_k(M)`), each with 3 and 4 stages; at BLOCK_N 64 the nearest one with 3 stages;
    for M <= MAX_STREAM_M stream-K at BLOCK_N 128 with 2 and 3 programs per SM (4 stages) when every
    program gets >= 2 units; for M <= 16 also BLOCK_N 64 at SPLIT_K 3 (`BN64_SPLIT3_MAX_M`) with one product
    per K-tile and 3 and 4 stages.
    4 warps, 8 at BLOCK_N 128 when M > 16 (fp6 at M = 32 over 4 warps: 200 registers per thread, at M = 64
    a spill)."""
    nt = num_k_tiles(K, tile)
    m_blocks = -(-M // MAX_SINGLE_BLOCK_M) if M > MAX_SINGLE_BLOCK_M else 1
    target = TARGET_PROGRAMS_PER_SM * sms
    splits = usable_splits(SPLIT_KS, M, nt)
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
        if bn == 64 and M <= BN64_SPLIT3_MAX_M and nt >= 6:
            out += [make_config(64, 3, 4, st, 1) for st in (3, 4)]
    return _dedup(out)


def usable_splits(splits, M: int, nt: int) -> list[int]:
    """The split counts of `splits` a problem of M rows and nt K-tiles can take: 1, and those that leave
    every split >= 2 K-tiles within `max_split_k(M)` (the workspace bound)."""
    return [sk for sk in splits if sk == 1 or (sk <= max_split_k(M) and nt >= 2 * sk)]


def _dedup(configs: list[dict]) -> list[dict]:
    seen, out = set(), []
    for c in configs:
        key = tuple(c.items())
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def describe(cfg: dict) -> str:
    """A config in a few characters, for logs and reports: e.g. "BN128 SK4 w4 s3 dot/field"."""
    grid = f"stream{cfg['STREAM']}/SM" if cfg.get("STREAM") else f"SK{cfg['SPLIT_K']}"
    one = {0: " dot/field", 1: " dot/tile"}.get(cfg.get("ONE_DOT"), "")
    return f"BN{cfg['BLOCK_N']} {grid} w{cfg['num_warps']} s{cfg['num_stages']}{one}"


def heuristic_config(M: int, K: int) -> dict:
    """One valid config for the interpreter (small tiles so tests exercise masking and several tiles)."""
    return {"BLOCK_N": 32, "SPLIT_K": 1, "ONE_DOT": 1, "STREAM": 0, "num_warps": 4, "num_stages": 2}


def block_m_for(M: int) -> int:
    """M padded for tl.dot: 16, 32 or 64; larger M is tiled in blocks of 64."""
    return 16 if M <= 16 else 32 if M <= 32 else 64


def tune_m(M: int) -> int:
    """The M the tuner keys on: M itself up to MAX_SINGLE_BLOCK_M (decode: the best split differs
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


def refuse_capture() -> None:
    """Tuning times CUDA graphs of its own: it cannot run inside a caller's capture."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the quantized matmul autotunes on its first call for each (M, N, K, format) and "
                           "cannot do so inside CUDA-graph capture: make one call with the same shapes "
                           "before capturing (a warm-up step)")


def l2_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


# more copies than this (weights under 2 x L2 / 16, 7.9 MB on the H200): the tuner times one weight after an
# L2 flush instead (`graph_bench`), as many launches per graph for a small weight cost more than they tell
MAX_COPIES = 16


def rotation_copies(bytes_per_call: int) -> int:
    """How many different weights of `bytes_per_call` back-to-back calls must cycle over so that none is
    still in L2 when its turn comes: >= 2 x L2 bytes per cycle (Note: the tuner's timer)."""
    return max(1, -(-2 * l2_bytes() // max(bytes_per_call, 1)))


def rotation_bench(call: Callable[[int], object], copies: int) -> float:
    """ms per call of `call(i)` (i: which weight copy, 0..copies-1): one CUDA graph of n rounds of
    call(0), ..., call(copies - 1) back to back (about GRAPH_MS of GPU time), the median of GRAPH_REPLAYS
    replays divided by the calls (Note: the tuner's timer). Raises inside a caller's graph capture."""
    refuse_capture()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            call(i)  # compiles on first use
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(copies):
            call(i)
        end.record()
        end.synchronize()
        rounds = max(1, min(400 // copies, int(GRAPH_MS / max(start.elapsed_time(end), 1e-3))))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(rounds):
                for i in range(copies):
                    call(i)
        times = sorted(_replay_ms(graph) for _ in range(GRAPH_REPLAYS))
    torch.cuda.current_stream().wait_stream(stream)
    return max(times[GRAPH_REPLAYS // 2] / (rounds * copies), 1e-6)


REFINE = 0.03  # candidates within 3% of the fastest are timed twice (Note: the tuner's timer)


# a candidate that does not compile for this GPU (e.g. more shared memory than it has) is skipped
_COMPILE_ERRORS = (OutOfResources, CompileTimeAssertionFailure, PTXASError)


def pick_fastest(candidates: list[dict], bench: Callable[[dict], float], what: str) -> tuple[dict, dict]:
    """(the fastest candidate, {candidate key: ms}) by `bench(config) -> ms`: every candidate once
    (those that do not compile for this GPU, e.g. too much shared memory, are skipped), then those
    within REFINE of the fastest once more, ranked by the mean of their two timings. `what` names the
    problem in the error raised when no candidate compiles."""
    timings = {}
    for cfg in candidates:
        try:
            timings[tuple(cfg.items())] = bench(dict(cfg))
        except _COMPILE_ERRORS:
            continue
    if not timings:
        raise RuntimeError(f"{what}: no kernel config fits this GPU")
    fastest = min(timings.values())
    close = [k for k, t in timings.items() if t <= fastest * (1 + REFINE)]
    if len(close) > 1:
        for k in close:
            timings[k] = (timings[k] + bench(dict(k))) / 2
    best = min(timings, key=timings.get)
    return dict(best), timings


TIMER_VERSION = 3  # in the disk cache's key: picks an older timer made are timed again


def _cache_file(kernel, key: tuple, candidates: list[dict]) -> tuple:
    """(triton's cache manager for this tuning, file name): the key holds what triton's own autotune
    cache holds (triton, backend, the kernel's source with its callees, cache-invalidating environment
    variables) plus the timer version, the GPU's name, the tune key and the candidates."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_manager, triton_key
    from triton.runtime.driver import driver

    parts = [triton_key(), make_backend(driver.active.get_current_target()).hash(), kernel.cache_key,
             str(sorted(get_cache_invalidating_env_vars().items())), f"timer{TIMER_VERSION}",
             torch.cuda.get_device_name(), repr(key), repr([sorted(c.items()) for c in candidates])]
    digest = hashlib.sha256("-".join(parts).encode()).hexdigest()
    return get_cache_manager(digest), f"{kernel.__name__}.tuning.json"


def cached_pick(kernel, key: tuple, candidates: list[dict], tune: Callable[[], tuple[dict, dict]]) -> dict:
    """The tuned config for `key`: from triton's cache directory when a process on the same GPU, triton,
    kernel source and timer tuned it before, else `tune()` (-> (config, {candidate key: ms})), whose pick
    is then stored there (JSON, written atomically). A cached file that is unreadable or names a config
    outside `candidates` is logged and tuned again; a cache directory that cannot be made or written
    (read-only file system) is logged once, and the picks are kept for this process only."""
    manager = path = None
    try:
        manager, name = _cache_file(kernel, key, candidates)
        path = manager.get_file(name)
    except (OSError, RuntimeError) as e:
        _cache_unavailable(e)
    if path is not None:
        try:
            with open(path) as f:
                cfg = json.load(f)["config"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            cfg = e
        if cfg in candidates:
            return dict(cfg)
        logger.warning("quantized kernels: ignoring the tuning cache file %s (%s); tuning again", path,
                       cfg if isinstance(cfg, Exception) else "not one of the candidates")
    best, timings = tune()
    if manager is not None:
        record = {"config": best, "timings_ms": {json.dumps(dict(k)): t for k, t in timings.items()}}
        try:
            manager.put(json.dumps(record), name)
        except (OSError, RuntimeError) as e:
            _cache_unavailable(e)
    return best


_cache_warned = False


def _cache_unavailable(error: Exception) -> None:
    global _cache_warned
    if not _cache_warned:
        _cache_warned = True
        logger.warning("quantized kernels: the tuning disk cache is unavailable (%s); tunings are kept for this "
                       "process only", error)


def graph_bench(kernel_call) -> float:
    """Timer v2 (ms per call): one CUDA graph of n x (L2 flush, call) minus one of n x flush,
    medians over replays. Triton's default (events around single calls after zeroing a buffer larger
    than L2: dirty lines the kernel's reads must write back, and no back-to-back launches) picked configs
    14% slower on average (worst 41%) than the fastest candidate in `benchmarks/fp6_gemm.py`'s timing
    on the H200; this timer's picks 1.1% (worst 6.9%), over 12 (shape, format, M) cells
    (`benchmarks/wq_autotune.py`; docs/benchmark-notes/quantized-gemm-tuning.md, 2026-11-30). Timer v2;
    v3 (`rotation_bench`) replaced it where the weight copies fit in memory (Note: the tuner's timer)."""
    refuse_capture()
    # the flush: a read of 2 x L2, which evicts the weight and leaves only clean lines, as the other
    # layers' weight reads before a decode step's matmul do (allocated per call: no memory kept after tuning)
    flush = torch.zeros(2 * l2_bytes() // 4, device="cuda", dtype=torch.float32)
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
    return max((sorted(times[1])[GRAPH_REPLAYS // 2] - sorted(times[0])[GRAPH_REPLAYS // 2]) / n, 1e-6)
