"""The Triton kernels for `y = x @ dequant(W).T` with a packed FP6 / INT8 / INT4 weight (tile-interleaved,
tile-major layout in `reference.py`); `triton.py` launches them (`wq_matmul`) and `grouped.py` runs their
split-K body over a MoE layer's experts. Imports triton; import lazily (`triton.py`'s Note on
TRITON_INTERPRET holds here too).

One kernel serves every M. A program owns a [BLOCK_M, BLOCK_N] output tile and a contiguous share of
the K-tiles (T = 128 values each). The weight is stored tile-major (`reference.py`): the rows of a
program's K-tile lie in BLOCK_N / 32 contiguous chunks, so its loads stream whole chunks (16-byte
vectors) rather than 32..128-byte pieces of rows kilobytes apart. Per K-tile it loads one
[BLOCK_N, T/4] tile of w units (half-words of the 4-bit plane; int8: 32-bit words) (+ fp6's
[BLOCK_N, T/4] lo bytes) and, for each field f = 0..3, makes with shifts and masks (inline PTX on
32-bit pairs for fp16 activations) the [BLOCK_N, T/4] fp16 weight tile of the *contiguous* K range
[k0 + f*T/4, k0 + (f+1)*T/4), loads the matching [BLOCK_M, T/4] x sub-tile and accumulates its
product: no reshape, gather or int->float convert. fp32 accumulator; the per-channel scale (and fp6's
2**12) is applied once in the epilogue, per-group scales once per group span (`SPG` sub-tiles).
int8 had plain bytes in K order until layout 5: its tile went through shared memory and came back in
2-byte reads, 401 SASS instructions per K-tile at M = 64 (int4 190); with fields, 227, and on the
H200 8192 x 28672 at M = 64 went from 121 to 81 us (cuBLAS fp16 119), M = 1 from 66 to 61 us.

SWAP (every format and M): the products are computed transposed,
acc^T [BLOCK_N, BLOCK_M] += w_f @ x_f^T, so on sm_90 the dequantized tile is wgmma's register operand A
and x^T its shared-memory operand B (BLOCK_N >= 64; M = 16 is wgmma's n16). Unswapped, M <= 32 runs
mma.sync, every warp reading all of x from shared memory (fp6 8192 x 28672, M = 1: 55 us vs 50 us
swapped), and M = 64 picks wgmma with both operands in shared memory, round-tripping every dequantized
tile through STS + CTA barriers (2x slower per byte).
ONE_DOT (autotuned): 1 joins the four field tiles into one [BLOCK_N, T] operand in K order (`_cat_fields`:
the field index lands on register bits of the wgmma operand layout, so nothing moves) and does one
product per K-tile: 16 HGMMAs and one wait. 0 does one product per field; Triton then waits after each
(4 waits per tile). Neither wins everywhere on the H200, so the tuner times both (x padding rows masked,
best of each: fp6 8192 x 28672 M = 1 per field 48.0 us, per tile 49.1; fp6 8192^2 M = 1 per field 17.6,
per tile 16.5; int4 8192 x 28672 M = 4 per field 36.9, per tile 35.1;
docs/benchmark-notes/quantized-gemm-padding-rows.md, 2026-11-30).
Each K-tile's products go to a fresh accumulator that is added to acc at the tile's end, which makes
the tile's wgmmas complete inside the iteration: left in flight across the loop back-edge (Triton's
default), int4 at BLOCK_N 128 / 4 warps gave wrong results on the H200 in most calls (the next tile's
dequant reusing the pending wgmma's A registers), at a cost of 2-4% for fp6. The add is `acc += one *
tile` with `one` a runtime 1.0: a plain add is folded into the tile's last dot, which would leave the
wgmmas pending across the back-edge again.

Stream-K (STREAM > 0, autotune candidates for M <= 16): a grid of STREAM programs per SM, each taking
an equal contiguous range of the (N block, K-tile) units, N block major; per N block it touches, a
plain K loop then a flush, the blocks split between programs summed by the last to arrive in program
order (`_stream_k_body`). It removes the wave quantization of split-K grids (H200, fp6 8192 x 28672,
M = 1..16: 49-52 us vs 51-57 split-K). Not above M = 16: fp6 at M = 32 with 8 warps gave wrong results
on the H200 (tuning.MAX_STREAM_M).

Grouped (`grouped.py`, a mixture-of-experts layer's experts): the same split-K body over a decode
step's routes (<= 64 rows), one grid slot per chosen expert.

x rows: M is padded to 16/32/64 (BLOCK_M, tl.dot's minimum is 16). The padding rows' x loads are masked
(`_x_sub`: row -1), so they send no request and read zeros; before f73c98b they re-read row M - 1
(clamped, no mask), and decode at M = 1..8 paid for 16 rows of x per K-tile from L2. Masked, on the H200:
fp6 8192^2 M = 1 17.5 -> 16.5 us, int4 8192 x 28672 M = 4 36.4 -> 35.1 us (best candidate each); products
in one dot per K-tile gained most (BN64 SK4 at M = 1: 24.5 -> 16.5 us; same notes, 2026-11-30). For
M <= 64 there is one M block and the grid is (N blocks, SPLIT_K); above, M is tiled in blocks of 64 with
SPLIT_K = 1 (from DEQUANT_MIN_M rows on, `wq_matmul` takes the prefill path instead: `triton.py`).
Split-K partials go to an fp32 workspace [SPLIT_K, M, N]; by default the last program of an N block to
finish (an acq_rel counter per output tile, reset by that program) sums them in the fixed split order, adds the
bias and writes y, so the result is deterministic and one launch does it all (`REDUCE = 1`).
`REDUCE = 0` (env LIGHTSPEED_WQ_REDUCE=kernel) uses a second tiny kernel instead.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lightspeed.ops.wquant.dequant import chunk_bytes, dequant_fields, hi_row_bytes, pick_field, unit_bytes


@triton.jit
def _k_tile(acc_in, one, x_ptr, w_ptr, w2_ptr, s_ptr, offs_mc, offs_nc, row_a, row_b, t, stride_xm, tstr,
            K: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
            SPG: tl.constexpr, FORMAT: tl.constexpr, PER_GROUP: tl.constexpr, X_BF16: tl.constexpr,
            INTERPRETED: tl.constexpr, ONE_DOT: tl.constexpr):
    """acc^T [BLOCK_N, BLOCK_M] fp32 += (x[:, tile t] @ dequant(W)[:, tile t].T)^T (per-group scales applied).
    row_a / row_b: each row's offset in its tile-0 chunk (row_a: w units, row_b: fp6 lo bytes); tile t's
    chunk is t * tstr bytes further (K-tile major chunks: tstr = one K-tile of every row group). The
    tile's products start from zero and are added as `acc_in + one * tile` (one: a runtime 1.0), so they
    complete before the next tile (module docstring)."""
    acc = tl.zeros_like(acc_in)
    k0 = t * TILE
    part = tl.zeros_like(acc)
    # per half (SUB = T/4: one; SUB = T/8: two) one [BLOCK_N, SUB] tile of w units (int8: 32-bit words,
    # else 16-bit half-words) (+ fp6 lo bytes)
    FW: tl.constexpr = TILE // 4  # field width: field f covers K [k0 + f*FW, k0 + (f+1)*FW)
    for hh in tl.static_range(FW // SUB):
        offs_c = tl.max_contiguous(tl.multiple_of(hh * SUB + tl.arange(0, SUB), SUB), SUB)
        w = tl.load(w_ptr + (row_a[:, None] + t * (tstr // unit_bytes(FORMAT))) + offs_c[None, :])
        lo = w
        if FORMAT == 0:
            lo = tl.load(w2_ptr + (row_b[:, None] + t * tstr) + offs_c[None, :])
        v0, v1, v2, v3 = dequant_fields(w, lo, FORMAT, X_BF16, INTERPRETED, True)
        if ONE_DOT and (not PER_GROUP) and SUB == FW:  # one product over the whole K-tile
            acc = tl.dot(_w_op(_cat_fields(v0, v1, v2, v3), INTERPRETED),
                         tl.trans(_x_sub(x_ptr, offs_mc, k0, stride_xm, K, TILE, TILE, INTERPRETED)), acc)
        else:
            for f in tl.static_range(4):
                acc, part = _sub_dot(acc, part, x_ptr, s_ptr, offs_mc, offs_nc, k0 + f * FW + hh * SUB, hh * 4 + f,
                                     stride_xm, pick_field(f, v0, v1, v2, v3), K, TILE, SUB, GROUP, NG, SPG, PER_GROUP,
                                     INTERPRETED)
    return acc_in + one * acc


@triton.jit
def _k_range(acc, one, t_start, t_end, x_ptr, w_ptr, w2_ptr, s_ptr, offs_mc, offs_nc, row_a, row_b, stride_xm,
             tstr, K: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
             SPG: tl.constexpr, FORMAT: tl.constexpr, PER_GROUP: tl.constexpr, X_BF16: tl.constexpr,
             INTERPRETED: tl.constexpr, ONE_DOT: tl.constexpr):
    """acc += the products of K-tiles t_start..t_end-1 (`_k_tile`): the K loop both grids run, pipelined
    over num_stages on the GPU."""
    if INTERPRETED:  # the interpreter (numpy 2) cannot run `range` over a computed bound
        t = t_start
        while t < t_end:
            acc = _k_tile(acc, one, x_ptr, w_ptr, w2_ptr, s_ptr, offs_mc, offs_nc, row_a, row_b, t, stride_xm, tstr,
                          K, TILE, SUB, GROUP, NG, SPG, FORMAT, PER_GROUP, X_BF16, INTERPRETED, ONE_DOT)
            t += 1
    else:
        for t in range(t_start, t_end):
            acc = _k_tile(acc, one, x_ptr, w_ptr, w2_ptr, s_ptr, offs_mc, offs_nc, row_a, row_b, t, stride_xm, tstr,
                          K, TILE, SUB, GROUP, NG, SPG, FORMAT, PER_GROUP, X_BF16, INTERPRETED, ONE_DOT)
    return acc


@triton.jit
def _cat_fields(v0, v1, v2, v3):
    """Four [BLOCK_N, FW] field tiles -> [BLOCK_N, 4 FW], column f * FW + c = field f's column c (the K-tile
    in K order). The field index becomes two register bits of the wgmma operand layout, which holds every
    16-column slab of K in each thread's registers, so no data moves (SASS: no shuffle, no shared memory)."""
    a = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [BN, FW, i, o] = v(2i + o)
    a = tl.permute(a, (0, 2, 3, 1))  # [BN, i, o, FW]
    return tl.reshape(a, (a.shape[0], 4 * a.shape[3]))


@triton.jit
def _x_sub(x_ptr, offs_mc, kst, stride_xm, K: tl.constexpr, TILE: tl.constexpr, WIDTH: tl.constexpr,
           INTERPRETED: tl.constexpr):
    """x[offs_mc, kst:kst+WIDTH] ([BLOCK_M, WIDTH], zero past K and on rows whose offs_mc is -1), fp32 under
    the interpreter. A row of -1 needs no product (past M; in `grouped.py` another expert's route): its
    load is masked, so it sends no request (module docstring: "x rows")."""
    offs_k = tl.max_contiguous(tl.multiple_of(kst + tl.arange(0, WIDTH), WIDTH), WIDTH)
    rows = offs_mc >= 0
    ptrs = x_ptr + tl.maximum(offs_mc, 0)[:, None] * stride_xm + offs_k[None, :]
    if K % TILE == 0:
        x = tl.load(ptrs, mask=rows[:, None], other=0.0)
    else:
        x = tl.load(ptrs, mask=rows[:, None] & (offs_k[None, :] < K), other=0.0)
    if INTERPRETED:  # the interpreter's bf16 tl.dot is wrong (triton 3.6); fp32 is exact for these operands
        x = x.to(tl.float32)
    return x


@triton.jit
def _w_op(v, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        v = v.to(tl.float32)
    return v


@triton.jit
def _sub_dot(acc, part, x_ptr, s_ptr, offs_mc, offs_nc, kst, i: tl.constexpr, stride_xm, wi,
             K: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
             SPG: tl.constexpr, PER_GROUP: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc^T += wi @ x[:, kst:kst+SUB]^T for sub-tile i of the K-tile: the dequantized tile is the register
    operand A of wgmma (per-group: the SPG sub-tiles of one group span are summed in `part` and scaled
    once; with two halves per field (SUB = T/8) SPG is 1 or the whole tile, so the (half, field)
    visiting order never splits a span)."""
    a = _w_op(wi, INTERPRETED)
    b = tl.trans(_x_sub(x_ptr, offs_mc, kst, stride_xm, K, TILE, SUB, INTERPRETED))
    if not PER_GROUP:
        acc = tl.dot(a, b, acc)
    else:  # SPG consecutive sub-tiles share one scale: sum them in `part`, then scale once
        if i % SPG == 0:
            part = tl.dot(a, b)
        else:
            part = tl.dot(a, b, part)
        if i % SPG == SPG - 1:
            g = tl.minimum(kst // GROUP, NG - 1)  # padding past K (x == 0 there): any valid group
            s = tl.load(s_ptr + offs_nc * NG + g).to(tl.float32)
            acc += part * s[:, None]
    return acc, part


@triton.jit(do_not_specialize=["M_KEY"])
def _wq_matmul_kernel(x_ptr, w_ptr, w2_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr,
                      M, N, stride_xm, out_scale, M_KEY,
                      K: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr, GROUP: tl.constexpr,
                      SPG: tl.constexpr, FORMAT: tl.constexpr, PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      X_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                      REDUCE: tl.constexpr, INTERPRETED: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, ONE_DOT: tl.constexpr, STREAM: tl.constexpr):
    """out [M, N] = x [M, K] @ dequant(W [N, K]).T (+ bias). K is a constexpr (one compile per layer width),
    so plane strides and tile counts are constants. STREAM = 0: grid (N blocks, SPLIT_K, M blocks)
    (`_split_k_body`); STREAM > 0: stream-K over a grid of STREAM programs per SM (`_stream_k_body`).
    M_KEY (not specialized on) is `tuning.tune_m(M)` >= 1, the source of the bodies' runtime 1.0. The
    config is `wq_matmul`'s tuner's pick; this source is part of its disk cache's key (`tuning.cached_pick`)."""
    if STREAM:
        _stream_k_body(x_ptr, w_ptr, w2_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, out_scale,
                       (M_KEY > 0).to(tl.float32), K,
                       TILE, SUB, GROUP, SPG, FORMAT, PER_GROUP, HAS_BIAS, X_BF16, BLOCK_M, INTERPRETED, ROWS,
                       BLOCK_N, ONE_DOT)
    else:
        pid_m = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        # rows past M: no x load (-1), never stored
        _split_k_body(x_ptr, w_ptr, w2_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, offs_m, offs_m < M,
                      tl.where(offs_m < M, offs_m, -1), pid_m * tl.num_programs(0), N, stride_xm, out_scale,
                      (M_KEY > 0).to(tl.float32), K, TILE, SUB, GROUP, SPG, FORMAT, PER_GROUP,
                      HAS_BIAS, X_BF16, BLOCK_M, REDUCE, INTERPRETED, ROWS, BLOCK_N, SPLIT_K, ONE_DOT)


@triton.jit
def _row_offsets(offs_nc, N, ROWS: tl.constexpr, TILE: tl.constexpr, FORMAT: tl.constexpr):
    """(row_a, row_b, tstr): each row's offset in its tile-0 chunk of the tile-major storage (reference.py:
    chunks of ROWS rows x one K-tile, K-tile major): row_a in w units (int8's 32-bit words or the 4-bit
    plane's half-words: T/4 per row either way), row_b fp6's lo bytes (after the chunk's hi rows); tstr the
    bytes from one K-tile's chunks to the next's (one K-tile of every row group)."""
    CHUNK: tl.constexpr = chunk_bytes(FORMAT, TILE, ROWS)
    grp = offs_nc // ROWS
    rin = offs_nc % ROWS
    row_a = grp * (CHUNK // unit_bytes(FORMAT)) + rin * (TILE // 4)
    row_b = grp * CHUNK + ROWS * hi_row_bytes(FORMAT, TILE) + rin * (TILE // 4)
    return row_a, row_b, tl.cdiv(N, ROWS) * CHUNK


@triton.jit
def _split_k_body(x_ptr, w_ptr, w2_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, offs_m, m_mask, offs_mc, tile_base,
                  N, stride_xm, out_scale, one, K: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr,
                  GROUP: tl.constexpr, SPG: tl.constexpr, FORMAT: tl.constexpr, PER_GROUP: tl.constexpr,
                  HAS_BIAS: tl.constexpr, X_BF16: tl.constexpr, BLOCK_M: tl.constexpr, REDUCE: tl.constexpr,
                  INTERPRETED: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                  ONE_DOT: tl.constexpr):
    """Program (n block, split) sums its share of the K-tiles for BLOCK_M rows: offs_m their rows of y [M, N]
    (stored where m_mask), offs_mc the rows of x they read (-1: none, `_x_sub`); split-K partials go through
    ws [SPLIT_K, M, N] (the tuner's candidates bound SPLIT_K by `max_split_k(M)`, hence its size),
    counted per output tile at cnt[tile_base + n].
    one: a runtime 1.0, so that `acc += one * tile` cannot be folded into the tile's last dot (module
    docstring); made from an argument triton never specializes (it turns integers equal to 1 into
    constants: N = 1, a [1, hidden] gate, made a compile error of `(N > 0)`)."""
    NT: tl.constexpr = (K + TILE - 1) // TILE  # K-tiles (K padded to a multiple of TILE)
    NG: tl.constexpr = K // GROUP
    TPS: tl.constexpr = (NT + SPLIT_K - 1) // SPLIT_K
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_nc = tl.minimum(offs_n, N - 1)
    row_a, row_b, tstr = _row_offsets(offs_nc, N, ROWS, TILE, FORMAT)  # tile-major storage (reference.py)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # transposed (SWAP in the module docstring)
    # per-channel scales and bias are read before the K loop: read after it, their DRAM latency would sit
    # between the last tile and the store, on every call's critical path
    if not PER_GROUP:
        s_n = tl.load(s_ptr + offs_nc).to(tl.float32)
    if HAS_BIAS:
        b_n = tl.load(b_ptr + offs_nc).to(tl.float32)
    t_start = pid_k * TPS
    acc = _k_range(acc, one, t_start, tl.minimum(t_start + TPS, NT), x_ptr, w_ptr, w2_ptr, s_ptr, offs_mc, offs_nc,
                   row_a, row_b, stride_xm, tstr, K, TILE, SUB, GROUP, NG, SPG, FORMAT, PER_GROUP, X_BF16,
                   INTERPRETED, ONE_DOT)
    acc = tl.trans(acc)
    if not PER_GROUP:
        acc = acc * s_n[None, :]
    acc = acc * out_scale
    out_mask = m_mask[:, None] & n_mask[None, :]
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += b_n[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + out_offs, acc, mask=out_mask)
        if REDUCE == 1:  # the last split of this output tile to arrive sums all partials in split order
            tl.debug_barrier()  # every thread's partial is written before the release below
            tile_id = tile_base + pid_n
            arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
                    total += tl.load(ws_ptr + s * M * N + out_offs, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += b_n[None, :]
                tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.store(cnt_ptr + tile_id, 0)  # ready for the next call (the launch boundary orders it)


@triton.jit
def _stream_k_body(x_ptr, w_ptr, w2_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, stride_xm, out_scale, one,
                   K: tl.constexpr, TILE: tl.constexpr, SUB: tl.constexpr, GROUP: tl.constexpr, SPG: tl.constexpr,
                   FORMAT: tl.constexpr, PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, X_BF16: tl.constexpr,
                   BLOCK_M: tl.constexpr, INTERPRETED: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                   ONE_DOT: tl.constexpr):
    """Stream-K (M <= MAX_STREAM_M, one M block). The U = N blocks x K-tiles units, N block major, are cut into P
    equal contiguous ranges, one per program, so every program streams the same weight bytes whatever
    the shape (no wave quantization, no split count to pick). A range crosses N blocks: one K loop per
    block it touches (`_stream_block`), each followed by a flush (`_stream_flush`)."""
    NT: tl.constexpr = (K + TILE - 1) // TILE  # K-tiles (K padded to a multiple of TILE)
    NG: tl.constexpr = K // GROUP
    p = tl.program_id(0)
    P = tl.num_programs(0)
    U = tl.cdiv(N, BLOCK_N) * NT
    u0 = (p.to(tl.int64) * U // P).to(tl.int32)
    u1 = ((p + 1).to(tl.int64) * U // P).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    offs_mc = tl.where(offs_m < M, offs_m, -1)  # rows past M: no x load (`_x_sub`)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # transposed
    b_last = (u1 - 1) // NT
    if INTERPRETED:  # while loops: the interpreter cannot run `range` over computed bounds
        b = u0 // NT
        while b <= b_last:
            acc = _stream_block(acc, one, b, u0, u1, p, P, U, x_ptr, w_ptr, w2_ptr, s_ptr, b_ptr, out_ptr, ws_ptr,
                                cnt_ptr, offs_m, offs_mc, M, N, stride_xm, out_scale, K, NT, TILE, SUB, GROUP, NG,
                                SPG, FORMAT, PER_GROUP, HAS_BIAS, X_BF16, BLOCK_M, INTERPRETED, ROWS, BLOCK_N, ONE_DOT)
            b += 1
    else:
        for b in range(u0 // NT, b_last + 1):
            acc = _stream_block(acc, one, b, u0, u1, p, P, U, x_ptr, w_ptr, w2_ptr, s_ptr, b_ptr, out_ptr, ws_ptr,
                                cnt_ptr, offs_m, offs_mc, M, N, stride_xm, out_scale, K, NT, TILE, SUB, GROUP, NG,
                                SPG, FORMAT, PER_GROUP, HAS_BIAS, X_BF16, BLOCK_M, INTERPRETED, ROWS, BLOCK_N, ONE_DOT)


@triton.jit
def _stream_block(acc, one, b, u0, u1, p, P, U, x_ptr, w_ptr, w2_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, offs_m,
                  offs_mc, M, N, stride_xm, out_scale, K: tl.constexpr, NT: tl.constexpr, TILE: tl.constexpr,
                  SUB: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, SPG: tl.constexpr, FORMAT: tl.constexpr,
                  PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, X_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                  INTERPRETED: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ONE_DOT: tl.constexpr):
    """Program p's K-tiles of N block b (those of its range [u0, u1)), summed by a plain K loop (pipelined
    like split-K's), then flushed (`_stream_flush`); returns the zeroed accumulator. The scales are read
    before the loop, off the flush's critical path."""
    offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_nc = tl.minimum(offs_n, N - 1)
    row_a, row_b, tstr = _row_offsets(offs_nc, N, ROWS, TILE, FORMAT)
    if PER_GROUP:
        s_n = tl.full((BLOCK_N,), 1.0, tl.float32)
    else:
        s_n = tl.load(s_ptr + offs_nc).to(tl.float32)
    acc = _k_range(acc, one, tl.maximum(u0 - b * NT, 0), tl.minimum(u1 - b * NT, NT), x_ptr, w_ptr, w2_ptr, s_ptr,
                   offs_mc, offs_nc, row_a, row_b, stride_xm, tstr, K, TILE, SUB, GROUP, NG, SPG, FORMAT, PER_GROUP,
                   X_BF16, INTERPRETED, ONE_DOT)
    _stream_flush(acc, s_n, b, p, P, U, offs_m, offs_n, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, out_scale, NT, HAS_BIAS,
                  BLOCK_M, BLOCK_N)
    return tl.zeros_like(acc)


@triton.jit
def _stream_flush(acc, s_n, b, p, P, U, offs_m, offs_n, b_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, out_scale,
                  NT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program p's sum over its units of N block b -> y. Block b's units are covered by programs
    first_p..last_p (program of unit v: ((v + 1) P - 1) // U). One program: it stores y. Several: each
    stores its partial in workspace slot b + q (unique: the programs covering block b + 1 start at or
    after the last one covering b) and the last to arrive (acq_rel counter per block, reset by it) sums
    the slots in program order (deterministic), adds the bias and stores y. acc is transposed."""
    acc = tl.trans(acc) * s_n[None, :] * out_scale
    m_mask = offs_m < M
    out_mask = m_mask[:, None] & (offs_n < N)[None, :]
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    first_p = (((b * NT + 1).to(tl.int64) * P - 1) // U).to(tl.int32)
    last_p = ((((b + 1) * NT).to(tl.int64) * P - 1) // U).to(tl.int32)
    if first_p == last_p:
        if HAS_BIAS:
            acc += tl.load(b_ptr + tl.minimum(offs_n, N - 1)).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        SLOT: tl.constexpr = BLOCK_M * BLOCK_N
        slot_offs = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(ws_ptr + (b + p) * SLOT + slot_offs, acc, mask=m_mask[:, None])
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
        if arrived == last_p - first_p:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            q = first_p
            while q <= last_p:  # program order: deterministic
                total += tl.load(ws_ptr + (b + q) * SLOT + slot_offs, mask=m_mask[:, None], other=0.0,
                                 cache_modifier=".cg")
                q += 1
            if HAS_BIAS:
                total += tl.load(b_ptr + tl.minimum(offs_n, N - 1)).to(tl.float32)[None, :]
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(cnt_ptr + b, 0)  # ready for the next call (the launch boundary orders it)


@triton.jit
def _split_reduce_kernel(ws_ptr, b_ptr, out_ptr, numel, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):  # fixed order: deterministic (same sums as the in-kernel fixup)
        acc += tl.load(ws_ptr + i * numel + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
