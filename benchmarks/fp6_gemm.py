"""Weight-only quantized GEMM (decode shapes): lightspeed's Triton kernels for FP6 e3m2 / INT8 / INT4
vs cuBLAS fp16 and bf16 (torch.matmul) in the same run.

Claim: FP6 is >= 2.2x faster than fp16 cuBLAS at M <= 16 and reaches >= 0.75 of the 6-bit byte floor
on the large shapes. Reported per (K x N, M, format): us per call, speed-up vs fp16 cuBLAS, achieved
weight bandwidth (packed weight + scales bytes / time) as a fraction of a measured device-to-device
copy bandwidth. Weights are rotated among enough copies that their total exceeds L2, so each call
reads its weight from HBM.

    python benchmarks/fp6_gemm.py                  # full table (GPU)
    python benchmarks/fp6_gemm.py --check          # every (shape, M, format) vs dequant + fp32 matmul (10 calls)
    python benchmarks/fp6_gemm.py --smoke          # tiny sizes; on CPU through the reference
    python benchmarks/fp6_gemm.py --json out.json  # also write the rows as JSON
    python benchmarks/fp6_gemm.py --configs-report # also every autotune candidate's time
    python benchmarks/fp6_gemm.py --timing events  # eager calls timed with events (launch overhead incl.)
    python benchmarks/fp6_gemm.py --deepspeed      # also DeepSpeed's FP6-LLM kernel (checked, then timed)
    python benchmarks/fp6_gemm.py --prefill        # large M: kernel vs dequantize-once + cuBLAS (GPU)
    python benchmarks/fp6_gemm.py --check-candidates  # every autotune candidate, not only the chosen one

Timing: by default a CUDA graph of back-to-back calls is replayed (kernel time as a captured decode
step sees it, for cuBLAS and ours alike); `--timing events` times eager calls, which includes the
Python/launch overhead whenever the CPU is slower than the kernel. The `config` column is the kernel
config the autotuner chose (BLOCK_M, BLOCK_N, SPLIT_K or stream-K programs per SM, warps, stages;
fp6/int4: one product per K-tile or per field).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

SHAPES = [(8192, 8192), (8192, 28672), (28672, 8192)]  # (K, N)
MS = [1, 2, 4, 8, 16, 32, 64]
PREFILL_MS = [128, 256, 512, 1024, 2048, 4096]
PREFILL_SHAPES = [(8192, 8192), (8192, 28672)]
FORMATS = ["fp6", "int8", "int4"]
L2_BYTES = 50 * 2**20  # H200
SMOKE_SHAPES = [(256, 384)]
SMOKE_MS = [1, 16]
CHECK_CALLS = 10


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lightspeed.ops.wquant as wq  # noqa: E402  (torch only; triton is imported on the first CUDA call)


def bench_us(fn, rotations: int, warmup_ms: float = 25.0, rep_ms: float = 100.0, timing: str = "graph") -> float:
    """us per call of fn(i) (i cycles over the weight copies). timing="graph": one CUDA graph of
    back-to-back calls, replayed (GPU time per call, no Python/launch overhead: what a captured decode
    step sees); "events": the median of CUDA events around each eager call (includes launch overhead
    when the CPU is slower than the kernel)."""
    if not torch.cuda.is_available():
        import time
        t0 = time.perf_counter()
        for i in range(3):
            fn(i % rotations)
        return (time.perf_counter() - t0) / 3 * 1e6
    for i in range(rotations):  # warm every copy (first call autotunes)
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(5):
        fn(i % rotations)
    end.record()
    torch.cuda.synchronize()
    est_ms = max(start.elapsed_time(end) / 5, 1e-3)
    if timing == "graph":
        # a multiple of the rotation count, about 1 ms of calls, at most ~400 launches in the graph
        calls = rotations * max(1, min(400 // rotations, int(1.0 / (est_ms * rotations)) + 1))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(3):
                fn(i % rotations)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i % rotations)
        graph.replay()
        torch.cuda.synchronize()
        reps = max(5, int(rep_ms / (est_ms * calls)))
        times = []
        for _ in range(reps):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        del graph
        times.sort()
        return times[len(times) // 2] * 1e3
    n_warm, n_rep = max(1, int(warmup_ms / est_ms)), max(10, int(rep_ms / est_ms))
    for i in range(n_warm):
        fn(i % rotations)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    torch.cuda.synchronize()
    for i in range(n_rep):
        starts[i].record()
        fn(i % rotations)
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2] * 1e3


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    if device.type != "cuda":
        return float("nan")
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = bench_us(lambda i: dst.copy_(src), 1, timing="events")
    return 2 * n / (us * 1e-6)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"8192x8192,8192x28672" -> [(K, N), ...]."""
    return [tuple(int(v) for v in sh.split("x")) for sh in text.split(",")]


def _rotations(bytes_per_copy: int) -> int:
    return max(4, -(-2 * L2_BYTES // max(bytes_per_copy, 1)))


def _config_str(cfg: dict) -> str:
    if not cfg:
        return "-"
    if "PATH" in cfg:
        return cfg["PATH"]
    from lightspeed.ops.wquant.tuning import describe

    return f"BM{cfg['BLOCK_M']} {describe(cfg)}"


def _chosen_config(device) -> tuple[dict, dict | None]:
    """The kernel config of the latest quantized_matmul call and the autotuner's timings for its key."""
    if device.type != "cuda":
        return {}, None
    from lightspeed.ops.wquant import triton as wt

    return wt.last_config(), wt.autotune_timings()


def _deepspeed_baseline(device, formats):
    """DeepSpeed's FP6 kernel (benchmarks/ds_fp6.py), or None with the reason printed."""
    if device.type != "cuda" or "fp6" not in formats:
        print("--deepspeed: needs CUDA and the fp6 format; no DeepSpeed rows")
        return None
    try:
        from benchmarks.ds_fp6 import DeepSpeedFP6

        ds = DeepSpeedFP6()
    except Exception as e:  # a benchmark baseline: say why it is missing, measure the rest
        print(f"--deepspeed: DeepSpeed's FP6 kernel is unavailable ({type(e).__name__}: {e}); no DeepSpeed rows")
        return None
    print(f"DeepSpeed FP6 kernel loaded in {ds.build_s:.0f} s (TORCH_CUDA_ARCH_LIST="
          f"{os.environ.get('TORCH_CUDA_ARCH_LIST')})")
    return ds


def run(shapes, ms, formats, device, check: bool, group_size, timing: str = "graph", configs_report: bool = False,
        deepspeed: bool = False):
    gen = torch.Generator().manual_seed(0)
    rows = []
    bw = copy_bandwidth(device)
    if bw == bw:
        print(f"device-to-device copy bandwidth: {bw / 1e12:.2f} TB/s")
    ds = _deepspeed_baseline(device, formats) if deepspeed else None
    for k, n in shapes:
        w_cpu = torch.randn(n, k, generator=gen) * 0.02
        w16 = w_cpu.to(device=device, dtype=torch.float16)
        base_rot = _rotations(w16.numel() * 2)
        dense = {dt: [w16.to(dt).clone() for _ in range(base_rot)] for dt in (torch.float16, torch.bfloat16)}
        packed = {}
        for fmt in formats:
            qw = wq.quantize(w16, fmt, group_size if fmt != "fp6" else None)
            packed[fmt] = [qw] + [wq.QuantizedWeight(qw.format, qw.shape, qw.group_size,
                                                     tuple(p.clone() for p in qw.planes), qw.scales.clone(), qw.dtype)
                                  for _ in range(_rotations(qw.num_bytes) - 1)]
        ds_packed = []
        if ds is not None and ds.supports(n, k):
            one = ds.pack(packed["fp6"][0])  # the same codes and scales as ours; copies for the rotation
            ds_packed = [one] + [tuple(t.clone() for t in one) for _ in range(len(packed["fp6"]) - 1)]
        elif ds is not None:
            print(f"  DeepSpeed's FP6 kernel needs N % 256 == 0 and K % 64 == 0: no DeepSpeed row for {k}x{n}")
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.float16)
            base = {}
            for dt, ws in dense.items():
                xd = x.to(dt)
                us = bench_us(lambda i: torch.matmul(xd, ws[i].T), len(ws), timing=timing)
                base[dt] = us
                rows.append(dict(K=k, N=n, M=m, impl="cublas_fp16" if dt == torch.float16 else "cublas_bf16", us=us,
                                 bytes=w16.numel() * 2, speedup_vs_fp16=1.0 if dt == torch.float16 else base[
                                     torch.float16] / us))
            for fmt, qws in packed.items():
                row = dict(K=k, N=n, M=m, impl=fmt, bytes=qws[0].num_bytes)
                wq.quantized_matmul(x, qws[0])  # autotunes this (shape, M, format) on its first call
                cfg, timings = _chosen_config(device)
                row["config"] = _config_str(cfg)
                if configs_report and timings:
                    best = min(timings.values())
                    print(f"  autotune {k}x{n} M={m} {fmt}: " + "; ".join(
                        f"{c} {t * 1e3:.1f}us{' *' if t == best else ''}" for c, t in sorted(timings.items(),
                                                                                            key=lambda kv: kv[1])))
                if check:  # several calls: a race in the kernel shows as some of them wrong
                    ref = x.float() @ wq.dequantize(qws[0]).to(device).T
                    err = max((wq.quantized_matmul(x, qws[0]).float() - ref).abs().max().item()
                              for _ in range(CHECK_CALLS))
                    scale = ref.abs().max().item()
                    row.update(max_abs_err=err, max_ref=scale, ok=bool(err <= 2e-3 * scale + 1e-3))
                us = bench_us(lambda i: wq.quantized_matmul(x, qws[i]), len(qws), timing=timing)
                row.update(us=us, speedup_vs_fp16=base[torch.float16] / us)
                rows.append(row)
            if ds_packed:  # always checked: built for the wrong architecture its kernel returns garbage
                ref = x.float() @ wq.dequantize(packed["fp6"][0]).to(device).T
                err = (ds(x, ds_packed[0], n).float() - ref).abs().max().item()
                us = bench_us(lambda i: ds(x, ds_packed[i], n), len(ds_packed), timing=timing)
                rows.append(dict(K=k, N=n, M=m, impl="ds_fp6", us=us, speedup_vs_fp16=base[torch.float16] / us,
                                 bytes=sum(t.numel() * t.element_size() for t in ds_packed[0]), max_abs_err=err,
                                 max_ref=ref.abs().max().item(),
                                 ok=bool(err <= 2e-3 * ref.abs().max().item() + 1e-3)))
            for r in rows[-(2 + len(packed) + (1 if ds_packed else 0)):]:
                r["bw_frac"] = r["bytes"] / (r["us"] * 1e-6) / bw if bw == bw else float("nan")
    return rows, bw


def run_prefill(shapes, ms, formats, group_size, timing: str = "graph", device: str = "cuda"):
    """Per (shape, format, M): the kernel path (M tiled in blocks of 64, every weight tile dequantized once
    per block) and the dequantize-once + cuBLAS path, both forced, with cuBLAS fp16 in the same run: the
    crossover that sets `triton.DEQUANT_MIN_M`. Weights are read once per call in both paths and the
    products are compute-bound here, so two weight copies rotate. device="cpu" only dry-runs the code
    (both paths are then the reference)."""
    from lightspeed.ops.wquant import triton as wt

    gen = torch.Generator().manual_seed(0)
    rows = []
    for k, n in shapes:
        w16 = (torch.randn(n, k, generator=gen) * 0.02).to(device, torch.float16)
        dense = [w16, w16.clone()]
        for fmt in formats:
            qw = wq.quantize(w16, fmt, group_size if fmt != "fp6" else None)
            qws = [qw, wq.QuantizedWeight(qw.format, qw.shape, qw.group_size, tuple(p.clone() for p in qw.planes),
                                          qw.scales.clone(), qw.dtype)]
            threshold = wt.DEQUANT_MIN_M[fmt]
            try:
                for m in ms:
                    x = torch.randn(m, k, generator=gen).to(device, torch.float16)
                    row = dict(K=k, N=n, M=m, fmt=fmt, threshold=threshold,
                               cublas_us=bench_us(lambda i: torch.matmul(x, dense[i].T), 2, timing=timing))
                    for path, min_m in (("kernel_us", 1 << 30), ("dense_us", 1)):
                        wt.DEQUANT_MIN_M[fmt] = min_m
                        wq.quantized_matmul(x, qws[0])  # autotunes the kernel path for this M
                        row[path] = bench_us(lambda i: wq.quantized_matmul(x, qws[i]), 2, timing=timing)
                    rows.append(row)
            finally:
                wt.DEQUANT_MIN_M[fmt] = threshold
    return rows


def check_candidates(shapes, ms, formats, group_size, device) -> list[dict]:
    """Every config the autotuner would time for each (shape, M, format), run directly CHECK_CALLS times
    against dequantize + fp32 matmul: a config that returns wrong results is usually also fast, so the
    autotuner would pick it (stream-K at M = 32 did, on the H200). On the CPU, under TRITON_INTERPRET=1,
    it dry-runs the same configs through the interpreter (one "SM")."""
    from lightspeed.ops.wquant import triton as wt
    from lightspeed.ops.wquant import tuning

    sms = tuning.num_sms() if device.type == "cuda" else 1
    gen = torch.Generator().manual_seed(0)
    rows = []
    for k, n in shapes:
        w16 = (torch.randn(n, k, generator=gen) * 0.02).to(device, torch.float16)
        for fmt in formats:
            qw = wq.quantize(w16, fmt, group_size if fmt != "fp6" else None)
            for m in ms:
                x = torch.randn(m, k, generator=gen).to(device, torch.float16)
                ref = x.float() @ wq.dequantize(qw).to(device).T
                scale = ref.abs().max().item()
                for cfg in tuning.candidate_configs(m, n, k, qw.tile, sms):
                    err = max((wt.wq_matmul(x, qw, config=cfg).float() - ref).abs().max().item()
                              for _ in range(CHECK_CALLS))
                    rows.append(dict(K=k, N=n, M=m, fmt=fmt, config=_config_str({"BLOCK_M": tuning.block_m_for(m),
                                                                               **cfg}),
                                     max_abs_err=err, max_ref=scale, ok=bool(err <= 2e-3 * scale + 1e-3)))
                    r = rows[-1]
                    print(f"{k:>6} x {n:<6}{m:>4}{fmt:>6}  {'ok  ' if r['ok'] else 'FAIL'}  {err:.3e} / {scale:.3f}"
                          f"  {r['config']}", flush=True)
    return rows


def print_prefill(rows) -> None:
    print(f"{'K x N':>14}{'fmt':>6}{'M':>6}{'cuBLAS us':>11}{'kernel us':>11}{'x cuBLAS':>9}{'dense us':>10}"
          f"{'x cuBLAS':>9}  faster  (wq_matmul takes)")
    for r in rows:
        faster = "kernel" if r["kernel_us"] < r["dense_us"] else "dense"
        takes = "dense" if r["M"] >= r["threshold"] else "kernel"
        print(f"{r['K']:>6} x {r['N']:<6}{r['fmt']:>6}{r['M']:>6}{r['cublas_us']:>11.1f}{r['kernel_us']:>11.1f}"
              f"{r['cublas_us'] / r['kernel_us']:>9.2f}{r['dense_us']:>10.1f}{r['cublas_us'] / r['dense_us']:>9.2f}"
              f"  {faster:<7} ({takes})")


def print_table(rows, check: bool) -> None:
    if check or any("ok" in r for r in rows):  # DeepSpeed rows are always checked
        print(f"{'K x N':>14}{'M':>4}{'fmt':>6}{'max_abs_err':>14}{'max|ref|':>11}  ok    config")
        for r in rows:
            if "ok" in r:
                print(f"{r['K']:>6} x {r['N']:<6}{r['M']:>4}{r['impl']:>6}{r['max_abs_err']:>14.3e}"
                      f"{r['max_ref']:>11.3f}"
                      f"  {'ok  ' if r['ok'] else 'FAIL'}  {r.get('config', '-')}")
    print(f"{'K x N':>14}{'M':>4}{'impl':>13}{'us':>10}{'x fp16':>8}{'MB read':>9}{'bw/copy':>9}  config")
    for r in rows:
        print(f"{r['K']:>6} x {r['N']:<6}{r['M']:>4}{r['impl']:>13}{r['us']:>10.1f}{r['speedup_vs_fp16']:>8.2f}"
              f"{r['bytes'] / 1e6:>9.1f}{r.get('bw_frac', float('nan')):>9.2f}  {r.get('config', '')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="also verify every (shape, M, format) vs the reference")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: reference path)")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON to PATH")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--ms", default=None, help="comma-separated M values")
    ap.add_argument("--group-size", type=int, default=None, help="int8/int4 group size (default per-channel)")
    ap.add_argument("--shapes", default=None, help="comma-separated KxN, e.g. 8192x8192,8192x28672")
    ap.add_argument("--timing", choices=("graph", "events"), default="graph",
                    help="graph: CUDA-graph replay of back-to-back calls (GPU time); events: eager calls")
    ap.add_argument("--configs-report", action="store_true",
                    help="print every autotune candidate's time per (shape, M, format)")
    ap.add_argument("--deepspeed", action="store_true",
                    help="also time DeepSpeed's FP6-LLM kernel on the same weights (JIT-built; benchmarks/ds_fp6.py)")
    ap.add_argument("--prefill", action="store_true",
                    help="large M (default 128..4096): the kernel path vs dequantize-once + cuBLAS, both forced")
    ap.add_argument("--check-candidates", action="store_true",
                    help="run every autotune candidate config against the reference (not only the chosen one)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    formats = [f for f in args.formats.split(",") if f]
    if args.prefill:
        if device.type != "cuda":
            print("--prefill times the GPU paths: it needs a CUDA device")
            return 2
        shapes = parse_shapes(args.shapes) if args.shapes else PREFILL_SHAPES
        ms = [int(v) for v in args.ms.split(",")] if args.ms else PREFILL_MS
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
        rows = run_prefill(shapes, ms, formats, args.group_size, args.timing)
        print_prefill(rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "prefill": rows}, f, indent=1)
        return 0
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: running --smoke sizes through the CPU reference")
        args.smoke = True
    shapes, ms = (SMOKE_SHAPES, SMOKE_MS) if args.smoke else (SHAPES, MS)
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    if args.check_candidates:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            print("--check-candidates runs the Triton kernel: it needs a CUDA device (or TRITON_INTERPRET=1)")
            return 2
        rows = check_candidates(shapes, ms, formats, args.group_size, device)
        bad = [r for r in rows if not r["ok"]]
        print(f"{len(rows)} candidate configs checked, {len(bad)} wrong")
        return 1 if bad else 0
    rows, bw = run(shapes, ms, formats, device, args.check, args.group_size, args.timing, args.configs_report,
                   args.deepspeed)
    print_table(rows, args.check)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "copy_bandwidth_Bps": bw, "check": args.check, "rows": rows}, f, indent=1)
    if not all(r["ok"] for r in rows if "ok" in r):
        print("CHECK FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
