"""Peak memory and time of `lightspeed.ops.wquant.quantize` on one large layer: the row-chunked
quantizer (QUANT_CHUNK values at a time) against quantizing the whole layer at once (the behaviour
before c9c159e), measured in the same run.

Claim: chunking bounds the quantizer's temporaries (its packing works in int64, tens of bytes a value),
so `init_inference` quantizing a 70B model layer by layer needs ~1 GiB beside the weights, not ~16.

    python benchmarks/quantize_memory.py                      # 28672 x 8192 fp16 on the GPU
    python benchmarks/quantize_memory.py --smoke              # 2048 x 1024 on the CPU (time only)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lightspeed.ops.wquant import quantize, reference  # noqa: E402


def measure(w: torch.Tensor, fmt: str, chunk: int) -> tuple[float, float]:
    """(ms, GiB of peak device memory above the start; nan on the CPU) of one quantize call."""
    gpu = w.is_cuda
    saved = reference.QUANT_CHUNK
    reference.QUANT_CHUNK = chunk
    try:
        quantize(w[:64], fmt)  # warm-up
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        q = quantize(w, fmt)
        if gpu:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        peak = (torch.cuda.max_memory_allocated() - start) / 2**30 if gpu else float("nan")
        del q
        return ms, peak
    finally:
        reference.QUANT_CHUNK = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="28672x8192", help="N x K of the weight (rows x in_features)")
    ap.add_argument("--formats", default="fp6,int8,int4")
    ap.add_argument("--smoke", action="store_true", help="a small weight on the CPU")
    args = ap.parse_args()
    if args.smoke:
        args.shape = "2048x1024"
    n, k = (int(v) for v in args.shape.lower().split("x"))
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(device, torch.float16)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"# quantize {n} x {k} fp16 on {name}, torch {torch.__version__}")
    print(f"{'format':<8}{'whole ms':>10}{'whole GiB':>11}{'chunked ms':>12}{'chunked GiB':>13}{'memory x':>10}")
    for fmt in [f.strip() for f in args.formats.split(",") if f.strip()]:
        w_ms, w_gib = measure(w, fmt, 1 << 62)
        c_ms, c_gib = measure(w, fmt, reference.QUANT_CHUNK)
        print(f"{fmt:<8}{w_ms:>10.0f}{w_gib:>11.2f}{c_ms:>12.0f}{c_gib:>13.2f}{w_gib / c_gib:>10.1f}")


if __name__ == "__main__":
    main()
