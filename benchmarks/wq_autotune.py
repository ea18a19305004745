"""How good are the weight-quantized kernel's autotune picks? (GPU)

Claim: `tuning.rotation_bench`, the tuner's timer (v3), picks configs within a few percent of the
fastest candidate as `benchmarks/fp6_gemm.py` times them; triton's default timer
(`triton.testing.do_bench`: single calls after zeroing a buffer larger than L2) picks configs that are
often 10-40% slower, and `tuning.graph_bench` (timer v2: an L2 flush before each call) a few percent.

For each (K x N, format, M) every tuning candidate (`tuning.candidate_configs`) is timed four ways:
- "truth": fp6_gemm.py's timing (CUDA graph of back-to-back calls, weights rotated over copies larger
  than L2), the baseline the picks are judged by;
- "do_bench": `triton.testing.do_bench(warmup=5, rep=20)`, the first timer;
- "graph_bench": `tuning.graph_bench`, timer v2;
- "rotation": `tuning.rotation_bench` over the copies the tuner makes (`triton._weight_copies`), v3
  (v2 for weights that would need more than `tuning.MAX_COPIES` copies, as the tuner does).
Each timer's pick is reported with its truth time as a ratio to the best truth time (1.000 = it picked
the fastest), and so is the config the tuner itself chose (`pick_fastest`: with a second timing of the
close candidates; a fresh process tunes afresh unless the tuning disk cache already holds the key).

    python benchmarks/wq_autotune.py
    python benchmarks/wq_autotune.py --shapes 8192x8192 --formats fp6 --ms 1,16 --verbose
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fp6_gemm import _config_str, _rotations, bench_us, parse_shapes  # noqa: E402

import lightspeed.ops.wquant as wq  # noqa: E402

CASES = [((8192, 8192), "fp6", [1, 2, 4, 8, 16]), ((8192, 28672), "fp6", [1, 16]), ((28672, 8192), "fp6", [1]),
         ((8192, 8192), "int8", [1, 4]), ((8192, 8192), "int4", [4, 16])]


def run_case(K: int, N: int, fmt: str, ms: list[int], verbose: bool, gen: torch.Generator) -> list[dict]:
    from triton.testing import do_bench

    from lightspeed.ops.wquant import triton as wt
    from lightspeed.ops.wquant import tuning

    dev = torch.device("cuda")
    w16 = (torch.randn(N, K, generator=gen) * 0.02).to(dev, torch.float16)
    q0 = wq.quantize(w16, fmt, None)
    qws = [q0] + [wq.quantize(w16, fmt, None) for _ in range(_rotations(q0.num_bytes) - 1)]
    del w16
    copies = wt._weight_copies(q0)
    out = []
    for M in ms:
        x = torch.randn(M, K, generator=gen).to(dev, torch.float16)
        rows = []
        for cfg in tuning.candidate_configs(M, N, K, q0.tile, tuning.num_sms()):
            def call(cfg=cfg):
                return wt.wq_matmul(x, q0, config=dict(cfg))

            call()
            torch.cuda.synchronize()
            name = _config_str({**cfg, "BLOCK_M": tuning.block_m_for(M)})
            row = {"config": name, "do_bench": do_bench(call, warmup=5, rep=20, return_mode="median") * 1e3,
                   "graph_bench": tuning.graph_bench(call) * 1e3,
                   "rotation": (tuning.graph_bench(call) if copies is None else tuning.rotation_bench(
                       lambda i, cfg=cfg: wt.wq_matmul(x, copies[i], config=dict(cfg)), len(copies))) * 1e3,
                   "truth": bench_us(lambda i, cfg=cfg: wt.wq_matmul(x, qws[i], config=dict(cfg)), len(qws))}
            rows.append(row)
            if verbose:
                print(f"  {K}x{N} {fmt} M={M} {name}: do_bench {row['do_bench']:.2f}  graph_bench "
                      f"{row['graph_bench']:.2f}  rotation {row['rotation']:.2f}  truth {row['truth']:.2f} us",
                      flush=True)
        wt.wq_matmul(x, q0)  # the tuner's own pick
        auto = _config_str(wt.last_config())
        best = min(r["truth"] for r in rows)
        res = {"K": K, "N": N, "fmt": fmt, "M": M, "best_us": best, "candidates": len(rows)}
        for timer in ("do_bench", "graph_bench", "rotation"):
            pick = min(rows, key=lambda r: r[timer])
            res[timer] = (pick["config"], pick["truth"] / best)
        auto_truth = [r["truth"] for r in rows if r["config"] == auto]
        res["autotuner"] = (auto, auto_truth[0] / best if auto_truth else float("nan"))
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", help="comma-separated KxN (default: the built-in cases)")
    ap.add_argument("--formats", default="fp6", help="with --shapes: comma-separated formats")
    ap.add_argument("--ms", default="1,4,16", help="with --shapes: comma-separated M values")
    ap.add_argument("--verbose", action="store_true", help="print every candidate's three times")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("wq_autotune.py times the Triton kernel's autotune candidates: it needs a CUDA device")
        return
    cases = CASES
    if args.shapes:
        ms = [int(m) for m in args.ms.split(",")]
        cases = [(shape, f, ms) for shape in parse_shapes(args.shapes) for f in args.formats.split(",")]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    results = []
    for (K, N), fmt, ms in cases:
        results += run_case(K, N, fmt, ms, args.verbose, gen)
        torch.cuda.empty_cache()
    timers = ("do_bench", "graph_bench", "rotation", "autotuner")
    print(f"{'K x N':>14}{'fmt':>6}{'M':>4}{'best us':>9}  " + "".join(f"{t + ' pick':<44}" for t in timers))
    for r in results:
        cols = [f"{r[t][1]:.3f} {r[t][0]}" for t in timers]
        print(f"{r['K']:>6} x {r['N']:<6}{r['fmt']:>6}{r['M']:>4}{r['best_us']:>9.2f}  "
              + "".join(f"{c:<44}" for c in cols))
    for t in timers:
        ratios = [r[t][1] for r in results]
        print(f"{t}: picks' truth time / best, mean {sum(ratios) / len(ratios):.3f}, worst {max(ratios):.3f}")


if __name__ == "__main__":
    main()
