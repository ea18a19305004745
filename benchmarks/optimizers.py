"""Optimizer step throughput.

GPU section (--gpu): lightspeed's Triton FusedAdam/FusedLion/FusedAdagrad/FusedLamb vs
torch.optim.AdamW(foreach=True), AdamW(fused=True) and DeepSpeed's FusedAdam (when deepspeed is
importable and its op builds), on fp32 params of ~1B elements in GPT-like shapes (multi-tensor) and
as one flat shard; then the mixed-precision ZeRO step (bf16 grads in, unscale/clip coefficient, fp32
master and states, bf16 params out) against the same work done with torch's/DeepSpeed's best pieces
(upcast+scale in one op, fused step, downcast copy). GB/s count the minimum bytes per element (Adam:
28 = read p, g, m, v + write p, m, v; mixed: 28 = read g(2) p m v + write p m v + bf16 copy(2); Lion,
Adagrad: 20; LAMB: 40 for its two passes) against a device copy measured in the same run. Also a
block-size / warps sweep of the Adam kernel on the flat form.

CPU section (--cpu): ours (CPUAdam) vs torch AdamW (foreach / fused) vs DeepSpeedCPUAdam (when
deepspeed is importable and its cpu_adam op builds), fp32 params, 1 and 2 threads; 28 B/elem against
a plain memory copy (dst.copy_(src), 8 bytes/element moved) measured in the same run.

    python benchmarks/optimizers.py --gpu [--elems 1e9] [--steps 10] [--no-sweep] [--json out.json]
    python benchmarks/optimizers.py --cpu [--sizes 100e6,500e6] [--threads 1,2] [--steps 3]
    python benchmarks/optimizers.py --smoke      # tiny sizes, seconds (CPU)
Run with a python that has deepspeed installed to include DeepSpeed's optimizers.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
            rows += _cpu_mixed_rows(n, th, steps, copy_gbs)
    return rows


def _cpu_mixed_rows(n: int, th: int, steps: int, copy_gbs: float) -> list[tuple]:
    """Mixed precision on the CPU (offload's case): bf16 params with fp32 states (22 B/elem: read p, g
    2 + m, v 4; write p 2, m, v 4), and an fp32 master whose bf16 copy is written in the same step
    (30 B/elem) against torch's fused AdamW followed by a separate copy_."""
    from lightspeed.ops.adam import CPUAdam

    rows = []
    lr, wd = 1e-3, 0.01
    p = torch.nn.Parameter(torch.randn(n).bfloat16())
    p.grad = torch.randn(n).bfloat16()
    makers = {"lightspeed CPUAdam bf16": lambda: CPUAdam([p], lr=lr, weight_decay=wd)}
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        makers["DeepSpeedCPUAdam bf16"] = lambda: DeepSpeedCPUAdam([p], lr=lr, weight_decay=wd)
    except Exception:  # noqa: BLE001 - optional peer
        pass
    for name, make in makers.items():
        opt = make()
        t = _time(opt.step, steps)
        gbs = 22 * n / t / 1e9
        rows.append((n, th, name + " (22 B)", t * 1e3, gbs, gbs / copy_gbs))
        del opt
    del p
    gc.collect()
    master = torch.nn.Parameter(torch.randn(n))
    master.grad = torch.randn(n)
    copy = torch.empty(n, dtype=torch.bfloat16)
    ours = CPUAdam([master], lr=lr, weight_decay=wd)
    t = _time(lambda: ours.step(fp16_param_groups=[[copy]]), steps)
    rows.append((n, th, "lightspeed fp32+bf16 copy (30 B)", t * 1e3, 30 * n / t / 1e9, 30 * n / t / 1e9 / copy_gbs))
    del ours
    torch_opt = torch.optim.AdamW([master], lr=lr, weight_decay=wd, fused=True)

    def torch_step():
        torch_opt.step()
        copy.copy_(master.detach())

    t = _time(torch_step, steps)
    rows.append((n, th, "torch fused + copy_ (30 B)", t * 1e3, 30 * n / t / 1e9, 30 * n / t / 1e9 / copy_gbs))
    del torch_opt, master, copy
    gc.collect()
    return rows


def print_table(rows) -> None:
    print(f"{'params':>8} {'thr':>3}  {'impl':<34} {'ms/step':>10} {'GB/s':>8} {'x copy':>7}")
    for r in rows:
        n, th, name, ms, gbs, ratio = r[:6]
        note = f"  {r[6]}" if len(r) > 6 else ""
        print(f"{n / 1e6:>7.0f}M {th:>3}  {name:<34} {ms:>10.1f} {gbs:>8.2f} {ratio:>7.2f}{note}")


# ---------------------------------------------------------------------------------------------- GPU
def gpt_shapes(total: float) -> list[tuple[int, ...]]:
    """GPT-like parameter shapes (width 2048, vocab 50304, tied embedding) adding up to about `total`."""
    d, vocab = 2048, 50304
    shapes: list[tuple[int, ...]] = [(vocab, d), (2048, d), (d,), (d,)]
    layer = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    per_layer = sum(math.prod(s) for s in layer)
    count = max(1, round((total - sum(math.prod(s) for s in shapes)) / per_layer))
    return shapes + layer * count


def _gpu_time(fn, steps: int, warmup: int = 3) -> float:
    """Median seconds of fn() over `steps` runs timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _ds_optimizers():
    try:
        from deepspeed.ops.adam import FusedAdam as DSFusedAdam

        return DSFusedAdam
    except Exception as e:  # noqa: BLE001 - optional peer
        return e


def run_gpu(total: float, steps: int, sweep: bool) -> list[dict]:
    from lightspeed.ops.adagrad import FusedAdagrad
    from lightspeed.ops.adam import FusedAdam
    from lightspeed.ops.lamb import FusedLamb
    from lightspeed.ops.lion import FusedLion

    dev = torch.device("cuda")
    rows: list[dict] = []
    n_copy = int(total)
    src = torch.empty(n_copy, device=dev)
    dst = torch.empty_like(src)
    copy_bw = 8 * n_copy / _gpu_time(lambda: dst.copy_(src), steps) / 1e9
    del src, dst
    _free()
    rows.append(dict(section="copy", impl="device copy (8 B/elem)", elems=n_copy, ms=float("nan"), gbs=copy_bw))

    def record(section, impl, elems, seconds, bytes_per_elem, note=""):
        gbs = bytes_per_elem * elems / seconds / 1e9
        rows.append(dict(section=section, impl=impl, elems=elems, ms=seconds * 1e3, gbs=gbs, x_copy=gbs / copy_bw,
                         note=note))
        print(f"  {section:<22} {impl:<34} {seconds * 1e3:8.2f} ms {gbs:8.0f} GB/s {gbs / copy_bw:5.2f}x copy {note}",
              flush=True)

    ds_cls = _ds_optimizers()
    lr, wd = 1e-4, 0.01
    adam_makers = {
        "lightspeed FusedAdam": lambda ps: FusedAdam(ps, lr=lr, weight_decay=wd),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd, foreach=True),
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd, fused=True),
    }
    if isinstance(ds_cls, Exception):
        print(f"  DeepSpeed FusedAdam unavailable: {ds_cls}")
    else:
        adam_makers["DeepSpeed FusedAdam"] = lambda ps: ds_cls(ps, lr=lr, weight_decay=wd, adam_w_mode=True)

    forms = {"fp32 GPT shapes": gpt_shapes(total), "fp32 one flat shard": [(int(total),)]}
    for section, shapes in forms.items():
        elems = sum(math.prod(s) for s in shapes)
        for impl, make in adam_makers.items():
            params = [torch.randn(s, device=dev) for s in shapes]
            for p in params:
                p.grad = torch.randn_like(p) * 1e-3
            opt = make(params)
            record(section, impl, elems, _gpu_time(opt.step, steps), 28)
            del opt, params
            _free()

    # the other families, GPT shapes
    shapes = forms["fp32 GPT shapes"]
    elems = sum(math.prod(s) for s in shapes)
    families = {
        "lightspeed FusedLion": (lambda ps: FusedLion(ps, lr=lr, weight_decay=wd), 20),
        "lightspeed FusedAdagrad": (lambda ps: FusedAdagrad(ps, lr=lr, weight_decay=wd), 20),
        "torch Adagrad foreach": (lambda ps: torch.optim.Adagrad(ps, lr=lr, weight_decay=wd, foreach=True), 20),
        "lightspeed FusedLamb": (lambda ps: FusedLamb(ps, lr=lr, weight_decay=wd), 40),
    }
    for impl, (make, nbytes) in families.items():
        params = [torch.randn(s, device=dev) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt = make(params)
        record("other families", impl, elems, _gpu_time(opt.step, steps), nbytes)
        del opt, params
        _free()

    # the mixed-precision ZeRO step on one flat shard
    n = int(total)
    master = torch.randn(n, device=dev)
    g16 = (torch.randn(n, device=dev) * 1e-3).bfloat16()
    lp = master.bfloat16()
    coef = torch.tensor(0.5, device=dev)
    ours = FusedAdam([master], lr=lr, weight_decay=wd)
    pieces = {master: [(0, lp)]}
    record("mixed bf16->fp32->bf16", "lightspeed fused ZeRO step", n,
           _gpu_time(lambda: ours.step(grads={master: g16}, grad_scale=coef, lowp_out=pieces), steps), 28)
    del ours
    _free()
    g32 = torch.empty(n, device=dev)
    baselines = {"torch: mul(out=fp32) + AdamW fused + copy": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=wd,
                                                                                            fused=True)}
    if not isinstance(ds_cls, Exception):
        baselines["DeepSpeed: mul(out=fp32) + FusedAdam + copy"] = lambda ps: ds_cls(ps, lr=lr, weight_decay=wd)
    for impl, make in baselines.items():
        master.grad = g32
        opt = make([master])

        def step():
            torch.mul(g16, coef, out=g32)
            opt.step()
            lp.copy_(master)

        record("mixed bf16->fp32->bf16", impl, n, _gpu_time(step, steps), 28, note="(40 B/elem moved)")
        del opt
        master.grad = None
        _free()
    del master, g16, lp, g32
    _free()

    if sweep:  # block size and warps of the Adam kernel, flat fp32 form
        from lightspeed.ops.adam import triton as kernels
        from lightspeed.ops.multi_tensor import plan

        p = torch.randn(n, device=dev)
        g, m, v = torch.randn_like(p) * 1e-3, torch.zeros_like(p), torch.zeros_like(p)
        arrays = [[p], [g], [m], [v]]
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                pl = plan(arrays, block)

                def launch():
                    kernels.launch(arrays, pl, None, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                                   adamw=True, step_size=lr, bc2_sqrt=1.0, num_warps=warps)

                record("sweep adam flat fp32", f"BLOCK={block} warps={warps}", n, _gpu_time(launch, steps), 28)
        del p, g, m, v
        _free()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run the CPU section (default when no GPU section)")
    ap.add_argument("--gpu", action="store_true", help="run the GPU section (Triton kernels, CUDA)")
    ap.add_argument("--elems", type=float, default=1e9, help="GPU: elements in all (default 1e9)")
    ap.add_argument("--no-sweep", action="store_true", help="GPU: skip the block-size sweep")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one timed step")
    ap.add_argument("--sizes", default="100e6,500e6")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.gpu:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, median of {args.steps} steps")
        rows = run_gpu(args.elems, args.steps, not args.no_sweep)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        if not args.cpu:
            return
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
