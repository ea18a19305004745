"""Compiled training step on one GPU: plain PyTorch eager and torch.compile, lightspeed ZeRO-1/2/3 eager
and `engine.compile()`, FSDP2 eager; and float8 against bf16, compiled, at 1.3B.

    python benchmarks/compile.py [--models gpt2-medium hf-gpt2-medium 1.3b] [--steps 10] [--warmup 3]
        [--no-float8] [--smoke]

Models: "gpt2-medium" and "1.3b" are examples/gpt.py (SDPA attention, tied embeddings); "hf-gpt2-medium"
is transformers' GPT2LMHeadModel of the same shape (SDPA). Micro batch 8 x seq 1024, bf16: lightspeed
keeps bf16 params with fp32 masters and AdamW state; plain PyTorch and FSDP2 keep fp32 params under
bf16 compute (autocast; FSDP2's MixedPrecisionPolicy with fp32 gradient reduction). Each run is a fresh
process (world size 1, NCCL), so peak memory is the run's own; inductor's on-disk cache is shared
between runs, so a graph compiled once (ZeRO-1's and ZeRO-2's are the same) is cheap the second time.
One table per model with ms/step, the ratio to plain eager, MFU (H200 bf16 dense peak) and peak memory.
--smoke: a tiny model on CPU/gloo with the aot_eager backend, to keep the script alive without a GPU.

On one H200, split in two so that each finishes well inside 8 minutes (each compiled run pays its
inductor compile in its first warm-up step; the parent prints each run's wall time):

    python benchmarks/compile.py --models gpt2-medium hf-gpt2-medium
    python benchmarks/compile.py --models 1.3b

At a data-parallel world of one, ZeRO-3's parameters view their shards (nothing to gather) and the
whole module compiles; `--zero3-gathers` runs stage 3 with the gathering units, hooks and per-block
regions that more ranks use, to measure that machinery on one GPU.

`--profile` adds dynamo's counters, the device's busy fraction and the top operators of 3 more steps
per run. `--curve N` trains N steps (no warm-up) on a learnable token pattern and compares float8's loss
curve with bf16's (both compiled ZeRO-2), e.g. at 1.3B:

    python benchmarks/compile.py --models 1.3b --only lightspeed:2:1:0 lightspeed:2:1:1 --curve 300

A model is also WIDTHxLAYERS (examples/gpt.py's GPTConfig.preset): 4096x8 is a 7B-shaped model of 8 layers,
for float8 against bf16 where the matmuls are 7B's:

    python benchmarks/compile.py --models 4096x8 --only lightspeed:2:1:0 lightspeed:2:1:1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightspeed  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    H200_BF16_PEAK_FLOPS, Result, peak_gib, print_table, reset_memory, sync, time_steps)
from examples.gpt import GPT, GPTConfig  # noqa: E402

LR = 1e-4
BASELINE = "plain eager"


def build(model: str, seq: int, device) -> tuple[torch.nn.Module, GPTConfig]:
    """The model (on `device`) and the demo-GPT config of its shape (for the FLOP count)."""
    size = {"hf-gpt2-medium": "gpt2-medium"}.get(model, model)
    cfg = GPTConfig.preset(size, block_size=seq)
    torch.manual_seed(0)
    if model.startswith("hf-"):
        from transformers import GPT2Config, GPT2LMHeadModel

        hf = GPT2Config(vocab_size=cfg.vocab_size, n_positions=seq, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                        n_head=cfg.n_head, attn_implementation="sdpa")
        with device:
            net = GPT2LMHeadModel(hf)
        net.loss_type = "ForCausalLM"  # unset, transformers logs from inside the compiled forward (a graph break)
        return net, cfg
    with device:
        return GPT(cfg), cfg


def loss_of(model_name: str, fwd, batch):
    if model_name.startswith("hf-"):
        return fwd(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
    return fwd(batch[:, :-1], batch[:, 1:])


def ds_config(stage: int, micro: int, bf16: bool, float8: bool) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if float8:
        cfg["float8"] = {"enabled": True, "recipe": "tensorwise", "filter_fqns": ["lm_head"]}
    return cfg


def run_one(args, model_name: str, system: str, stage: int, compiled: bool, float8: bool) -> Result:
    lightspeed.init_distributed(verbose=False)
    if args.zero3_gathers:  # stage 3 as at more ranks: gather, release and hooks, though one rank holds all
        from lightspeed.zero.stage3 import strategy as stage3_strategy

        stage3_strategy.ONE_RANK_VIEWS = False
    gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    backend = "inductor" if gpu else "aot_eager"
    base, cfg = build(model_name, args.seq, device)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.micro, args.seq + 1), generator=g).to(device) for _ in range(4)]
    if args.curve:
        batches = pattern_batches(cfg.vocab_size, args.micro, args.seq, args.curve, device)
    it = iter(range(10**9))
    reset_memory()
    name = f"{system}{'' if system != 'lightspeed' else f' ZeRO-{stage}'} {'compiled' if compiled else 'eager'}"
    name += " float8" if float8 else ""
    name += " (gathering)" if args.zero3_gathers and system == "lightspeed" and stage == 3 else ""
    if system == "plain":
        model = base
        fwd = torch.compile(model, backend=backend) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=gpu)

        def step():
            b = batches[next(it) % len(batches)]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
                loss = loss_of(model_name, fwd, b)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    elif system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = base
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if gpu else None, reduce_dtype=torch.float32)
        blocks = model.blocks if hasattr(model, "blocks") else model.transformer.h
        for block in blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=gpu)

        def step():
            b = batches[next(it) % len(batches)]
            loss = loss_of(model_name, model, b)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    else:
        engine, *_ = lightspeed.initialize(model=base, model_parameters=base.parameters(),
                                           config=ds_config(stage, args.micro, gpu, float8))
        if compiled:
            engine.compile(backend=backend)

        def step():
            b = batches[next(it) % len(batches)]
            loss = loss_of(model_name, engine, b)
            engine.backward(loss)
            engine.step()
            return loss.detach()

    ms, losses = time_steps(step, args.curve or args.steps, 0 if args.curve else args.warmup,
                            repeats=1 if args.curve else args.repeats)
    if args.profile:
        profile_steps(step, name)
    r = Result(name, ms_per_step=ms, losses=losses)
    r.tokens_per_s = args.micro * args.seq / (ms / 1e3)
    with torch.device("meta"):
        flops = GPT(cfg).flops_per_token(args.seq)
    r.mfu = flops * r.tokens_per_s / H200_BF16_PEAK_FLOPS
    r.peak_gib = peak_gib()
    r.note = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    dist.destroy_process_group()
    return r


def pattern_batches(vocab: int, micro: int, seq: int, n: int, device) -> list[torch.Tensor]:
    """`n` distinct batches of a learnable pattern (each token repeats the one 7 back half of the
    time), so a loss curve shows learning rather than the entropy of random tokens."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (n, micro, seq + 1), generator=g)
    data[..., 7:] = torch.where(torch.rand(data[..., 7:].shape, generator=g) < 0.5, data[..., :-7], data[..., 7:])
    return [d.to(device) for d in data]


def compare_curves(results: list[Result]) -> None:
    """float8 against bf16 (compiled ZeRO-2): the loss curves, smoothed over 20 steps, and their gap."""
    by_name = {r.name: r.losses for r in results if r.losses}
    base, f8 = by_name.get("lightspeed ZeRO-2 compiled"), by_name.get("lightspeed ZeRO-2 compiled float8")
    if not base or not f8:
        print("  (the curve needs both lightspeed:2:1:0 and lightspeed:2:1:1)")
        return
    def smooth(xs: list[float]) -> list[float]:
        return [sum(xs[max(0, i - 19):i + 1]) / len(xs[max(0, i - 19):i + 1]) for i in range(len(xs))]

    b, f = smooth(base), smooth(f8)
    gaps = [abs(x - y) / x for x, y in zip(b, f)]
    half = len(gaps) // 2
    print(f"== loss curves, {len(base)} steps, smoothed over 20: bf16 {b[0]:.3f} -> {b[-1]:.3f}, float8 "
          f"{f[0]:.3f} -> {f[-1]:.3f}; float8's gap to bf16: last {f[-1] / b[-1] - 1:+.2%}, largest over the "
          f"second half {max(gaps[half:]):.2%}")
    for i in range(0, len(b), max(1, len(b) // 10)):
        print(f"  step {i + 1:>4}: bf16 {b[i]:.4f}  float8 {f[i]:.4f}")


def profile_steps(step, name: str, steps: int = 3) -> None:
    """Where `steps` more steps spend their time: dynamo's counters, the device's busy fraction, and
    the top operators by device and by host time (torch.profiler), printed."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    began = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync()
    wall_us = (time.perf_counter() - began) * 1e6
    events = prof.key_averages()
    print(f"-- profile of {name}: {steps} steps, {wall_us / 1e3 / steps:.1f} ms/step under the profiler")
    print("   dynamo: " + ", ".join(f"{k}={dict(v)}" for k, v in counters.items() if k in (
        "stats", "graph_break", "recompiles", "frames")))
    if torch.cuda.is_available():
        busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"   device kernels busy {busy / wall_us:.2f} of the wall time")
        print(events.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=60))


def runs_for(model: str, float8: bool) -> list[tuple[str, int, bool, bool]]:
    out = [("plain", 0, False, False), ("plain", 0, True, False)]
    out += [("lightspeed", s, c, False) for s in (1, 2, 3) for c in (False, True)]
    out += [("fsdp2", 0, False, False)]
    if float8 and (model == "1.3b" or re.fullmatch(r"\d+x\d+", model)):  # and WIDTHxLAYERS, e.g. 7B-shaped 4096x8
        out += [("lightspeed", 2, True, True)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["gpt2-medium", "hf-gpt2-medium", "1.3b"])
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed windows of --steps steps; ms/step is the median window's (two runs of one "
                         "configuration differed by 30%% with a single window)")
    ap.add_argument("--no-float8", action="store_true", help="skip the float8 run at 1.3B")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (keeps the script alive in CI)")
    ap.add_argument("--profile", action="store_true", help="also profile 3 steps of each run (printed)")
    ap.add_argument("--curve", type=int, default=0, metavar="N",
                    help="N steps on a learnable pattern, no warm-up; compares float8's loss curve with bf16's")
    ap.add_argument("--only", nargs="+", default=None, metavar="SYSTEM:STAGE:COMPILED:FLOAT8",
                    help="run only these (e.g. plain:0:1:0 lightspeed:2:1:0); the baseline is always run")
    ap.add_argument("--zero3-gathers", action="store_true",
                    help="ZeRO-3 gathers and releases each block as at more ranks (at one rank it otherwise "
                         "views its shards)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # model:system:stage:compiled:float8
    args = ap.parse_args()
    if args.smoke:
        os.environ["LIGHTSPEED_ACCELERATOR"] = "cpu"
        args.models, args.micro, args.seq, args.steps, args.warmup = ["demo"], 2, 32, 2, 1
    if args.one:
        model, system, stage, compiled, float8 = args.one.split(":")
        result = run_one(args, model, system, int(stage), compiled == "1", float8 == "1")
        print("RESULT " + json.dumps(asdict(result)), flush=True)
        return
    passthrough = [a for a in sys.argv[1:] if a not in (args.only or [])]
    passthrough = [a for a in passthrough if a != "--only"]
    for model in args.models:
        hw = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
        print(f"\n== {model}: micro batch {args.micro} x seq {args.seq}, {hw}, torch {torch.__version__}, "
              f"world size 1, each run in a fresh process", flush=True)
        results = []
        chosen = runs_for(model, not args.no_float8 and not args.smoke)
        if args.only:
            keep = set(args.only) | (set() if args.curve else {"plain:0:0:0"})  # a curve needs no baseline
            chosen = [r for r in chosen if f"{r[0]}:{r[1]}:{int(r[2])}:{int(r[3])}" in keep]
        for system, stage, compiled, float8 in chosen:
            env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(29600 + len(results)))
            one = f"{model}:{system}:{stage}:{int(compiled)}:{int(float8)}"
            began = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, *passthrough, "--one", one], env=env,
                                  capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if args.profile:
                print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("RESULT ")), flush=True)
            if line is None:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                results.append(Result(one, note=f"failed: {tail[:160]}"))
            else:
                results.append(Result(**json.loads(line[len("RESULT "):])))
            print(f"  {results[-1].name}: {results[-1].ms_per_step:.1f} ms/step, {results[-1].peak_gib:.2f} GiB "
                  f"({time.perf_counter() - began:.0f} s)", flush=True)
        print_table(results, BASELINE)
        if args.curve:
            compare_curves(results)


if __name__ == "__main__":
    main()
