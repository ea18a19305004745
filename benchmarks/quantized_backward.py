"""The input gradient through a quantized layer (adapters trained on a frozen quantized model):
`torch.ops.lightspeed.quantized_matmul_grad_input` (the Triton dequantizer in row chunks + cuBLAS)
against the reference dequantization it replaced (int64 unpacking in torch ops) and against fp16
F.linear's backward on the dense weight, in the same run.

Claim: the quantized layer's backward costs about what the dense layer's does, not several times more.

    python benchmarks/quantized_backward.py                 # H200: Llama-2-70B's MLP shapes, 2048 tokens
    python benchmarks/quantized_backward.py --smoke         # small, CPU (reference only)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lightspeed.ops.wquant  # noqa: E402,F401  (registers the operators)
from lightspeed.ops.wquant import dequantize, quantize  # noqa: E402


def timed(fn, reps: int) -> float:
    """ms per call (median of reps, each synchronized)."""
    fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="28672x8192,8192x28672,8192x8192", help="N x K (out x in features)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--formats", default="fp6,int8,int4")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.shapes, args.tokens, args.reps = "256x512", 64, 3
    dtype = torch.float16 if device == "cuda" else torch.float32
    op = torch.ops.lightspeed.quantized_matmul_grad_input
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; torch {torch.__version__}; "
          f"{args.tokens} tokens, {dtype}")
    print("| N x K | format | dense F.linear backward ms | operator ms (x dense) | reference dequant ms (x dense) |"
          " max rel diff |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.lower().split("x"))
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02).to(device, dtype)
        grad = torch.randn(args.tokens, n, device=device, dtype=dtype)
        dense = timed(lambda: grad @ w, args.reps)
        for fmt in args.formats.split(","):
            qw = quantize(w, fmt)
            call = (grad, list(qw.planes), qw.scales, qw.format, n, k, qw.group_size, qw.dtype, qw.tile)
            ours = timed(lambda: op(*call), args.reps)
            ref = timed(lambda: grad @ dequantize(qw, dtype=dtype), args.reps)
            a, b = op(*call).float(), (grad @ dequantize(qw, dtype=dtype)).float()
            diff = float((a - b).abs().max() / b.abs().max())
            print(f"| {n} x {k} | {fmt} | {dense:.2f} | {ours:.2f} ({ours / dense:.2f}x) | {ref:.2f} "
                  f"({ref / dense:.2f}x) | {diff:.1e} |", flush=True)
            del qw
        del w, grad


if __name__ == "__main__":
    main()
