"""ZeRO step time on one GPU (NCCL, world size 1): lightspeed stages 0-3 against plain PyTorch
(bf16 autocast + torch.optim.AdamW(fused=True)) and DeepSpeed's engine, same model, batch and precision.

    python benchmarks/zero_step.py [--sizes gpt2-medium 1.3b] [--stages 0 1 2 3]
        [--micro 8] [--seq 1024] [--steps 20] [--deepspeed] [--compile] [--cuda-graph] [--smoke]

--cuda-graph also runs each lightspeed stage with `optimizer.cuda_graph` (the fused step's launches
captured once and replayed, zero/graphed_step.py), times the optimizer step alone (`engine.step()`
between synchronizations, after a timed forward/backward) for both, and prints a second table: step
and optimizer-step times without and with the captured step, and their ratios. On CPU (--smoke) the
captured runs are refused (CUDA only) and show n/a.

Each configuration runs in a fresh process (world size 1, NCCL on GPU), so no run inherits memory
or state from another; the parent prints one table per model size.

Model: examples/gpt.py (SDPA attention, tied embeddings). lightspeed and DeepSpeed keep bf16 params
with fp32 master weights and AdamW state (DeepSpeed's bf16 semantics); plain PyTorch keeps fp32
params under autocast. --smoke runs a tiny model on CPU/gloo so CI-like machines can keep the
script alive.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightspeed  # noqa: E402
from benchmarks.harness import (H200_BF16_PEAK_FLOPS, Result, peak_gib, print_table, reset_memory, sync,  # noqa: E402
                                time_steps)
from lightspeed.config.errors import ConfigError  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

LR = 1e-4


def make_batches(vocab: int, micro: int, seq: int, device, n: int = 4):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (micro, seq + 1), generator=g).to(device) for _ in range(n)]


def ds_config(stage: int, micro: int, bf16: bool, torch_adam: bool, cuda_graph: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1, "torch_adam": torch_adam}}}
    if cuda_graph:  # lightspeed's own key (DeepSpeed runs never set it)
        cfg["optimizer"]["cuda_graph"] = True
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def bench_plain(base: GPT, batches, args, device) -> Result:
    reset_memory()
    model = copy.deepcopy(base).to(device)
    fwd = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=device.type == "cuda")
    amp = device.type == "cuda"
    it = iter(range(10**9))

    def step():
        b = batches[next(it) % len(batches)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = fwd(b[:, :-1], b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    ms, losses = time_steps(step, args.steps, args.warmup)
    return finish(Result("plain PyTorch (autocast)"), ms, losses, base, args)


def bench_engine(initialize, name: str, base: GPT, batches, args, device, stage: int, torch_adam: bool,
                 cuda_graph: bool = False) -> Result:
    reset_memory()
    model = copy.deepcopy(base)
    try:
        engine, *_ = initialize(model=model, model_parameters=model.parameters(),
                                config=ds_config(stage, args.micro, device.type == "cuda", torch_adam, cuda_graph))
    except (NotImplementedError, ConfigError) as err:
        return Result(name, note=f"n/a: {err}")
    fwd = torch.compile(engine.module) if args.compile else engine
    it = iter(range(10**9))

    def step():
        b = batches[next(it) % len(batches)]
        loss = fwd(b[:, :-1].to(engine.device), b[:, 1:].to(engine.device))
        engine.backward(loss)
        engine.step()
        return loss.detach()

    ms, losses = time_steps(step, args.steps, args.warmup)
    result = finish(Result(name), ms, losses, base, args)
    if args.cuda_graph:
        result.note += f"; optimizer step {optimizer_step_ms(engine, fwd, batches, args.steps):.2f} ms"
    del engine, model
    return result


def optimizer_step_ms(engine, fwd, batches, steps: int) -> float:
    """Mean time of `engine.step()` alone: each after a forward/backward, between synchronizations."""
    total = 0.0
    for i in range(steps):
        b = batches[i % len(batches)]
        engine.backward(fwd(b[:, :-1].to(engine.device), b[:, 1:].to(engine.device)))
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        total += time.perf_counter() - t0
    return total * 1e3 / max(steps, 1)


def print_graph_table(results: list[Result], stages: list[int]) -> None:
    """Per stage: the step and the optimizer step without / with optimizer.cuda_graph, and with / without."""
    by_name = {r.name: r for r in results}
    print(f"\n{'optimizer.cuda_graph':<22}{'step ms':>9}{'graphed':>9}{'ratio':>7}{'opt ms':>9}{'graphed':>9}{'ratio':>7}")
    for stage in stages:
        off, on = by_name.get(f"lightspeed ZeRO-{stage}"), by_name.get(f"lightspeed ZeRO-{stage} graphed")
        if off is None or on is None:
            continue
        opt_off, opt_on = _opt_ms(off), _opt_ms(on)
        print(f"{'ZeRO-' + str(stage):<22}{off.ms_per_step:>9.2f}{on.ms_per_step:>9.2f}"
              f"{on.ms_per_step / off.ms_per_step:>7.3f}{opt_off:>9.2f}{opt_on:>9.2f}{opt_on / opt_off:>7.3f}")


def _opt_ms(r: Result) -> float:
    marker = "optimizer step "
    if marker not in r.note:
        return float("nan")
    return float(r.note.split(marker)[1].split(" ms")[0])


def finish(r: Result, ms: float, losses, base: GPT, args) -> Result:
    r.ms_per_step, r.losses = ms, losses
    tokens = args.micro * args.seq
    r.tokens_per_s = tokens / (ms / 1e3)
    r.mfu = base.flops_per_token(args.seq) * r.tokens_per_s / H200_BF16_PEAK_FLOPS
    r.peak_gib = peak_gib()
    r.note = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    return r


def run_one(args, size: str, system: str, stage: int) -> Result:
    """One configuration, in this process (the parent runs each in a fresh one: no leftovers)."""
    lightspeed.init_distributed(verbose=False)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    cfg = GPTConfig.preset(size, block_size=args.seq)
    with device:  # initialised where it trains: a 1.3B model's CPU init alone takes many seconds
        base = GPT(cfg)
    batches = make_batches(cfg.vocab_size, args.micro, args.seq, device)
    if system == "plain":
        result = bench_plain(base, batches, args, device)
    elif system in ("lightspeed", "graphed"):
        graphed = system == "graphed"
        result = bench_engine(lightspeed.initialize, f"lightspeed ZeRO-{stage}" + (" graphed" if graphed else ""),
                              base, batches, args, device, stage, torch_adam=False, cuda_graph=graphed)
    else:
        import deepspeed

        result = bench_engine(deepspeed.initialize, f"DeepSpeed ZeRO-{stage}", base, batches, args, device, stage,
                              torch_adam=False)
    dist.destroy_process_group()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["gpt2-medium", "1.3b"])
    ap.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--deepspeed", action="store_true", help="also run DeepSpeed's engine (must be importable)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model's forward")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also each lightspeed stage with optimizer.cuda_graph, and the optimizer step alone")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (keeps the script alive in CI)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # size:system:stage, run in a child
    args = ap.parse_args()
    if args.smoke:
        os.environ["LIGHTSPEED_ACCELERATOR"] = "cpu"
        args.sizes, args.micro, args.seq, args.steps, args.warmup = ["demo"], 2, 32, 2, 1
    if args.one:
        size, system, stage = args.one.split(":")
        print("RESULT " + json.dumps(asdict(run_one(args, size, system, int(stage)))), flush=True)
        return
    import torch.distributed.run  # noqa: F401  (only to fail early when torch lacks it)

    passthrough = [a for a in sys.argv[1:] if a not in ("--deepspeed",)]
    for size in args.sizes:
        cfg = GPTConfig.preset(size, block_size=args.seq)
        with torch.device("meta"):
            num_params = GPT(cfg).num_params()
        hw = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
        print(f"\n== {size}: {num_params / 1e6:.0f}M params, micro batch {args.micro} x seq {args.seq}, {hw}, "
              f"torch {torch.__version__}, world size 1, each run in a fresh process"
              f"{', compiled' if args.compile else ''}", flush=True)
        runs = [("plain", 0)] + [("lightspeed", s) for s in args.stages]
        runs += [("graphed", s) for s in args.stages] if args.cuda_graph else []
        runs += [("deepspeed", s) for s in args.stages] if args.deepspeed else []
        results = []
        for system, stage in runs:
            env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(29500 + len(results)))
            proc = subprocess.run([sys.executable, __file__, *passthrough, "--one", f"{size}:{system}:{stage}"],
                                  env=env, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                name = {"plain": "plain PyTorch (autocast)", "graphed": f"lightspeed ZeRO-{stage} graphed"}.get(
                    system, f"{system} ZeRO-{stage}")
                results.append(Result(name, note=f"failed: {tail[:120]}"))
            else:
                results.append(Result(**json.loads(line[len("RESULT "):])))
        print_table(results, "plain PyTorch (autocast)")
        if args.cuda_graph:
            print_graph_table(results, args.stages)


if __name__ == "__main__":
    main()
