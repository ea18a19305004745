"""Optimizer step throughput. CPU section: ours (CPUAdam) vs torch AdamW (foreach / fused) vs
DeepSpeedCPUAdam (when deepspeed is importable and its cpu_adam op builds), fp32 params, 1 and 2 threads.

Reports ms/step and GB/s counting 28 bytes/element (read p, g, m, v; write p, m, v), and the ratio to a
plain memory copy (dst.copy_(src), 8 bytes/element moved) measured in the same run.

    python benchmarks/optimizers.py --cpu [--sizes 100e6,500e6] [--threads 1,2] [--steps 3]
    python benchmarks/optimizers.py --smoke      # tiny sizes, seconds
Run with a python that has deepspeed installed to include DeepSpeedCPUAdam.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

BYTES_PER_ELEM = 28


def _time(fn, steps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(n: int, steps: int) -> float:
    """GB/s of dst.copy_(src) over n fp32 elements (read + write counted)."""
    src = torch.randn(n)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), steps)
    del src, dst
    return 8 * n / t / 1e9


def inplace_stream_bandwidth(n: int, steps: int) -> float:
    """GB/s of a.add_(b) over n fp32 elements (read a, b; write a in place: 12 B/elem). Like the optimizers,
    it writes where it reads (no separate destination), and with two input streams it reaches more of the
    bandwidth than one-stream copy_ does on a core."""
    a, b = torch.randn(n), torch.randn(n)
    t = _time(lambda: a.add_(b), steps)
    del a, b
    return 12 * n / t / 1e9


def _make_optimizers(lr=1e-3, wd=0.01):
    from lightspeed.ops.adam import CPUAdam

    makers = {
        "lightspeed CPUAdam": lambda ps: CPUAdam(ps, lr=lr, weight_decay=wd, adamw_mode=True),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd, foreach=True),
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd, fused=True),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401

        makers["DeepSpeedCPUAdam"] = lambda ps: DeepSpeedCPUAdam(ps, lr=lr, weight_decay=wd, adamw_mode=True)
    except Exception as e:  # noqa: BLE001 - optional peer
        makers["DeepSpeedCPUAdam"] = e
    return makers


def run_cpu(sizes: list[int], threads: list[int], steps: int, shapes: str = "flat") -> list[tuple]:
    rows = []
    makers = _make_optimizers()
    for n in sizes:
        for th in threads:
            torch.set_num_threads(th)
            copy_gbs = copy_bandwidth(n, steps)
            rows.append((n, th, "memory copy (8 B/elem)", float("nan"), copy_gbs, 1.0))
            stream_gbs = inplace_stream_bandwidth(n, steps)
            rows.append((n, th, "a.add_(b) (12 B/elem)", float("nan"), stream_gbs, stream_gbs / copy_gbs))
            p = torch.nn.Parameter(torch.randn(n))
            p.grad = torch.randn(n)
            for name, make in makers.items():
                if isinstance(make, Exception):
                    rows.append((n, th, name, float("nan"), float("nan"), float("nan"), f"unavailable: {make}"))
                    continue
                opt = make([p])
                t = _time(opt.step, steps)
                gbs = BYTES_PER_ELEM * n / t / 1e9
                rows.append((n, th, name, t * 1e3, gbs, gbs / copy_gbs))
                del opt
                gc.collect()
            del p
            gc.collect()
    return rows


def print_table(rows) -> None:
    print(f"{'params':>8} {'thr':>3}  {'impl':<24} {'ms/step':>10} {'GB/s':>8} {'x copy':>7}")
    for r in rows:
        n, th, name, ms, gbs, ratio = r[:6]
        note = f"  {r[6]}" if len(r) > 6 else ""
        print(f"{n / 1e6:>7.0f}M {th:>3}  {name:<24} {ms:>10.1f} {gbs:>8.2f} {ratio:>7.2f}{note}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run the CPU section (default when no GPU section)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one timed step")
    ap.add_argument("--sizes", default="100e6,500e6")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.smoke:
        sizes, threads, steps = [100_003], [1], 1
    else:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
        threads = [int(t) for t in args.threads.split(",")]
        steps = args.steps
    print(f"torch {torch.__version__}, CPU, {BYTES_PER_ELEM} B/elem for Adam, median of {steps} steps")
    print_table(run_cpu(sizes, threads, steps))


if __name__ == "__main__":
    main()
