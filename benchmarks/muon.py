"""Muon's optimizer step at GPT 1.3B (ZeRO-1, world 1, bf16 params with fp32 masters) against lightspeed's
fused AdamW step, and DeepSpeed's Muon when `--deepspeed` (DeepSpeed importable: run with its venv's python).

    python benchmarks/muon.py [--size 1.3b] [--micro 4] [--seq 1024] [--steps 10] [--deepspeed] [--smoke]

Two tables:
1. Newton-Schulz alone on the model's distinct matrix shapes (lightspeed.ops.muon): DeepSpeed's
   op-for-op iteration (the reference), the fused fast path eagerly and torch.compile'd, per method;
   ms for one iteration of every hidden matrix of the model, and the ratio to the reference.
2. The engine step (`engine.step()` after a backward, synchronised around it: norm, clip, optimizer,
   parameter write-back) and the whole iteration (forward + backward + step): lightspeed AdamW
   (FusedAdam) and lightspeed Muon (gram / standard), DeepSpeed Muon; ms and the ratio to lightspeed
   AdamW. Each in a fresh process. DeepSpeed's ZeRO-1/2 orthogonalise at the end of backward (its
   gradient partitioning), so its "step" column leaves Muon out: compare iterations.

The GPT's token and position embeddings sit under a module named `embed`, so DeepSpeed's rule (which
both engines apply at initialize) sends them, the tied head, biases and norms to Adam, and the 4 x
n_layer hidden matrices to Muon. `--smoke` runs a tiny GPT on CPU (keeps the script alive in CI).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.gpt import GPT, GPTConfig  # noqa: E402

LR = 1e-4


class Named(torch.nn.Module):
    """The GPT with its embeddings first under `embed` (the names DeepSpeed's Muon rule reads)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.embed = torch.nn.ModuleDict({"wte": gpt.wte, "wpe": gpt.wpe})
        self.gpt = gpt

    def forward(self, idx, targets):
        return self.gpt(idx, targets)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------ NS


def bench_ns(args, device) -> None:
    from lightspeed.ops.muon import newton_schulz, newton_schulz_reference

    cfg = GPTConfig.preset(args.size, block_size=args.seq)
    with torch.device("meta"):
        model = GPT(cfg)
    shapes: dict[tuple, int] = {}
    for name, p in model.named_parameters():
        if p.ndim == 2 and name.startswith("blocks"):
            shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
    g = torch.Generator(device=device).manual_seed(0)
    mats = {s: torch.randn(s, generator=g, device=device) for s in shapes}
    print(f"\n== Newton-Schulz, {args.size} hidden matrices {dict(shapes)}, {device}")
    print(f"{'method':<10}{'path':<22}{'ms (all)':>11}{'vs ref':>9}")
    for method in ("gram", "standard"):
        runs = [("reference", lambda G: newton_schulz_reference(G, method=method)),
                ("fast (eager)", lambda G: newton_schulz(G, method=method, compile=False))]
        if device.type == "cuda" or args.compile_cpu:
            runs.append(("fast (compiled)", lambda G: newton_schulz(G, method=method, compile=True)))
        base = None
        for label, fn in runs:
            per = {s: timed(lambda: fn(m), device, args.steps, 2) for s, m in mats.items()}
            total = sum(per[s] * n for s, n in shapes.items())
            base = base or total
            print(f"{method:<10}{label:<22}{total:>11.2f}{total / base:>9.2f}", flush=True)


# ------------------------------------------------------------------------------------------------ step


def ds_config(optimizer: str, ns_method: str, micro: int, bf16: bool) -> dict:
    if optimizer == "adamw":
        opt = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}
    else:
        opt = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": LR, "weight_decay": 0.1, "ns_method": ns_method}}
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "optimizer": opt}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def run_one(args, system: str, optimizer: str, ns_method: str) -> dict:
    if system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() and not args.smoke else "gloo")
        initialize = deepspeed.initialize
    else:
        import lightspeed

        lightspeed.init_distributed(verbose=False)
        initialize = lightspeed.initialize
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    cfg = GPTConfig.preset(args.size, block_size=args.seq)
    with device:
        model = Named(GPT(cfg))
    engine, *_ = initialize(model=model, model_parameters=model.parameters(),
                            config=ds_config(optimizer, ns_method, args.micro, device.type == "cuda"))
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (args.micro, args.seq + 1), generator=g).to(device)
    times, iters, losses = [], [], []
    for i in range(args.warmup + args.steps):
        sync(device)
        start = time.perf_counter()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
            iters.append((time.perf_counter() - start) * 1e3)
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    muon = sum(p.numel() for p in model.parameters() if getattr(p, "use_muon", False))
    dist.destroy_process_group()
    return {"ms": statistics.median(times), "iter_ms": statistics.median(iters), "peak_gib": peak, "loss": f"{losses[0]:.3f} -> {losses[-1]:.3f}",
            "muon_params": muon}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.3b")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deepspeed", action="store_true", help="also DeepSpeed's Muon (must be importable)")
    ap.add_argument("--no-ns", action="store_true", help="skip the Newton-Schulz table")
    ap.add_argument("--compile-cpu", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny GPT on CPU")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # system:optimizer:ns_method, in a child
    args = ap.parse_args()
    if args.smoke:
        os.environ["LIGHTSPEED_ACCELERATOR"] = "cpu"
        args.size, args.micro, args.seq, args.steps, args.warmup = "demo", 2, 32, 2, 1
        torch.set_num_threads(1)  # a shared CPU: threads fighting each other time nothing useful
    if args.one:
        system, optimizer, ns_method = args.one.split(":")
        print("RESULT " + json.dumps(run_one(args, system, optimizer, ns_method)), flush=True)
        return
    device = torch.device("cuda") if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    if not args.no_ns:
        bench_ns(args, device)
    runs = [("lightspeed", "adamw", "-"), ("lightspeed", "muon", "gram"), ("lightspeed", "muon", "standard")]
    if args.deepspeed:
        runs += [("deepspeed", "muon", "gram"), ("deepspeed", "muon", "standard")]
    hw = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"\n== optimizer step, {args.size}, ZeRO-1, world 1, micro {args.micro} x seq {args.seq}, {hw}, "
          f"torch {torch.__version__}, each run in a fresh process")
    print(f"{'run':<30}{'step ms':>9}{'vs AdamW':>10}{'iter ms':>9}{'vs AdamW':>10}{'peak GiB':>10}  note")
    base = None
    passthrough = [a for a in sys.argv[1:] if a != "--deepspeed"]
    for i, (system, optimizer, ns) in enumerate(runs):
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(29600 + i))
        proc = subprocess.run([sys.executable, __file__, *passthrough, "--one", f"{system}:{optimizer}:{ns}"],
                              env=env, capture_output=True, text=True)
        name = f"{system} {'AdamW' if optimizer == 'adamw' else 'Muon ' + ns}"
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"{name:<30}{'failed':>9}  {tail[:160]}", flush=True)
            continue
        r = json.loads(line[len("RESULT "):])
        base = base or r
        note = f"loss {r['loss']}" + (f", {r['muon_params'] / 1e6:.0f}M params on Muon" if optimizer == "muon" else "")
        print(f"{name:<30}{r['ms']:>9.2f}{r['ms'] / base['ms']:>10.2f}{r['iter_ms']:>9.2f}"
              f"{r['iter_ms'] / base['iter_ms']:>10.2f}{r['peak_gib']:>10.2f}  {note}", flush=True)


if __name__ == "__main__":
    main()
