"""How long any kernel needs just to read a decode GEMM's packed weight once on this GPU: a Triton kernel
that only streams the bytes (each program folds a contiguous share of 32-bit words with xor), the
fastest over grid sizes, block widths, warps and pipeline depths, next to cuBLAS fp16's matmul of the
same shape at M = 1 and M = 16, measured in the same run.

Claim: the goal "FP6 >= 2.2x fp16 cuBLAS" asks a kernel to finish in cuBLAS time / 2.2. This
script measures how much of that budget reading the FP6 (or INT4) weight alone takes, fixed costs
included (launch, the first DRAM round trips, the last programs' tail), which the "byte floor" of
`fp6_gemm.py` (bytes over a 1 GiB copy's bandwidth) leaves out. What remains is what dequantization,
the products and the split-K reduction may cost. Weights rotate over copies larger than L2, and calls
replay back to back from a CUDA graph, as in `fp6_gemm.py`.

    python benchmarks/read_floor.py                    # the GEMM table's shapes, fp6 and int4 (GPU)
    python benchmarks/read_floor.py --smoke            # the read kernel under TRITON_INTERPRET on CPU
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.fp6_gemm import SHAPES, _rotations, bench_us, copy_bandwidth  # noqa: E402

BITS = {"fp6": 6, "int4": 4, "int8": 8}
PROGRAMS_PER_SM = (1, 2, 3, 6)
BLOCKS = (1024, 4096)  # 32-bit words per program per iteration
WARPS = (4, 8)
STAGES = (3, 4)


def packed_bytes(fmt: str, K: int, N: int) -> int:
    """The packed weight and its fp16 per-channel scales, as the kernels read them."""
    return K * N * BITS[fmt] // 8 + 2 * N


def _kernel():
    import triton
    import triton.language as tl

    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

    @triton.jit
    def read_kernel(src, out, words_per_prog, total, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                    INTERPRETED: tl.constexpr):
        p = tl.program_id(0)
        start = tl.multiple_of(p * words_per_prog, BLOCK)
        acc = tl.zeros((BLOCK,), tl.int32)
        if INTERPRETED:  # the interpreter cannot run `range` over a runtime bound
            off = 0
            while off < words_per_prog:
                idx = start + off + tl.arange(0, BLOCK)
                acc ^= tl.load(src + idx, mask=idx < total, other=0)
                off += BLOCK
        else:
            for off in tl.range(0, words_per_prog, BLOCK, num_stages=STAGES):
                idx = start + off + tl.arange(0, BLOCK)
                acc ^= tl.load(src + idx, mask=idx < total, other=0)
        tl.store(out + p, tl.xor_sum(acc, 0))

    return functools.partial(_launch, read_kernel, interpreted), triton.cdiv


def _launch(kernel, interpreted, grid, *args, **kwargs):
    kernel[grid](*args, INTERPRETED=interpreted, **kwargs)


def read(kernel, cdiv, src: torch.Tensor, out: torch.Tensor, programs: int, block: int, warps: int, stages: int):
    """xor of every word of `src`, one partial per program in `out[:programs]`."""
    per = cdiv(cdiv(src.numel(), programs), block) * block
    kernel((programs,), src, out, per, src.numel(), BLOCK=block, STAGES=stages, num_warps=warps)


def smoke() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    kernel, cdiv = _kernel()
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(-2**31, 2**31 - 1, (10_007,), generator=gen, dtype=torch.int32)
    want = 0
    for v in src.tolist():
        want ^= v
    for programs, block in ((3, 1024), (7, 4096)):
        out = torch.zeros(programs, dtype=torch.int32)
        read(kernel, cdiv, src, out, programs, block, 4, 3)
        got = 0
        for v in out.tolist():
            got ^= v
        print(f"smoke: {programs} programs x {block} words: xor {'ok' if got == want else 'WRONG'}")
        if got != want:
            raise SystemExit(1)


def run(args) -> None:
    device = torch.device("cuda")
    kernel, cdiv = _kernel()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bw = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'K x N':>13} {'fmt':>5} {'MB':>7} {'cuBLAS M=1':>11} {'M=16':>7} {'2.2x needs':>11} "
          f"{'read us':>8} {'of copy bw':>11} {'left at M=1 / 16':>17}  read config")
    gen = torch.Generator().manual_seed(0)
    for K, N in args.shapes:
        dense = [(torch.randn(N, K, generator=gen) * 0.02).to(device, torch.float16)
                 for _ in range(_rotations(N * K * 2))]
        cublas = {}
        for M in (1, 16):
            x = torch.randn(M, K, generator=gen).to(device, torch.float16)
            cublas[M] = bench_us(lambda i: torch.matmul(x, dense[i].T), len(dense))
        del dense
        for fmt in args.formats:
            nbytes = packed_bytes(fmt, K, N)
            words = -(-nbytes // 4)
            bufs = [torch.randint(-2**31, 2**31 - 1, (words,), device=device, dtype=torch.int32)
                    for _ in range(_rotations(nbytes))]
            out = torch.empty(max(PROGRAMS_PER_SM) * sms, device=device, dtype=torch.int32)
            best = None
            for per_sm, block, warps, stages in itertools.product(PROGRAMS_PER_SM, BLOCKS, WARPS, STAGES):
                cfg = (per_sm * sms, block, warps, stages)
                us = bench_us(lambda i: read(kernel, cdiv, bufs[i], out, *cfg), len(bufs))
                if best is None or us < best[0]:
                    best = (us, per_sm, block, warps, stages)
            us, per_sm, block, warps, stages = best
            need = {M: cublas[M] / 2.2 for M in cublas}
            print(f"{K:>6} x {N:<6}{fmt:>5} {nbytes / 1e6:>7.1f} {cublas[1]:>11.1f} {cublas[16]:>7.1f} "
                  f"{need[1]:>5.1f} / {need[16]:<4.1f} {us:>8.2f} {nbytes / (us * 1e-6) / bw:>11.2f} "
                  f"{need[1] - us:>8.1f} / {need[16] - us:<6.1f}  {per_sm}/SM, {block} words, w{warps} s{stages}",
                  flush=True)
            del bufs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="check the read kernel under TRITON_INTERPRET (CPU)")
    ap.add_argument("--formats", default="fp6,int4")
    ap.add_argument("--shapes", default=None, help="comma-separated KxN (default: fp6_gemm.py's)")
    args = ap.parse_args(argv)
    if args.smoke:
        smoke()
        return
    if not torch.cuda.is_available():
        raise SystemExit("read_floor.py times a GPU: run it with CUDA, or pass --smoke")
    args.formats = [f for f in args.formats.split(",") if f]
    for f in args.formats:
        if f not in BITS:
            ap.error(f"--formats: unknown format {f!r} (known: {', '.join(BITS)})")
    args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    run(args)


if __name__ == "__main__":
    main()
