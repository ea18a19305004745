"""bf16 master weights and optimizer state (``bf16.bf16_master_weights_and_grads`` +
``bf16.bf16_optimizer_states``) against fp32 masters and state: peak memory, step time and the
engine's memory breakdown at ZeRO stages 1, 2 and 3, on one GPU.

    python benchmarks/low_precision_state.py [--device cuda] [--size 1.3b] [--stages 1 2 3]
        [--micro 4] [--seq 1024] [--steps 20] [--deepspeed] [--smoke]

Each configuration runs in a fresh process (world size 1), so no run inherits memory from another.
Rows: lightspeed with fp32 state (bf16 params, fp32 master and Adam moments: DeepSpeed's bf16
default) and with bf16 state, per stage; with --deepspeed (DeepSpeed importable) the same two
configurations through DeepSpeed's engine, as a baseline. The optimizer is the config's AdamW
(lightspeed's FusedAdam, DeepSpeed's FusedAdam); the loss of the first and last step is printed so
the two states can be compared for drift. The breakdown column is lightspeed's
``engine.memory_breakdown()`` (master + optimizer state, GiB): with bf16 state it is half of fp32's at
stages 1-2; at stage 3 the bf16 shard is stepped in place and no master is kept.

Expected on a 1.3B GPT (1.32e9 parameters, one rank): fp32 state holds 4 B master + 8 B Adam per
parameter (~15.8 GiB), bf16 state 2 + 4 (~7.9 GiB) at stages 1-2 and 0 + 4 at stage 3.
--smoke runs a tiny model on CPU/gloo (no GPU needed), to keep the script working.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightspeed  # noqa: E402
from benchmarks.harness import Result, engine_step, peak_gib, print_table, reset_memory, time_steps  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

LR = 1e-4


def ds_config(stage: int, micro: int, lowp: bool) -> dict:
    bf16 = {"enabled": True}
    if lowp:
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
            "gradient_clipping": 1.0, "bf16": bf16, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}}}


def state_gib(engine) -> float:
    """Master + optimizer-state bytes of lightspeed's breakdown, on every device, in GiB."""
    total = 0
    for cats in engine.memory_breakdown().values():
        total += cats.get("master_params", 0) + cats.get("optimizer_state", 0)
    return total / 2**30


def run_one(args, system: str, stage: int, lowp: bool) -> Result:
    lightspeed.init_distributed(verbose=False)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    cfg = GPTConfig.preset(args.size, block_size=args.seq)
    with device:
        base = GPT(cfg)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.micro, args.seq + 1), generator=g).to(device) for _ in range(4)]
    name = f"{system} ZeRO-{stage} {'bf16' if lowp else 'fp32'} state"
    reset_memory()
    model = copy.deepcopy(base)
    del base
    if system == "lightspeed":
        initialize = lightspeed.initialize
    else:
        import deepspeed

        initialize = deepspeed.initialize
    try:
        engine, *_ = initialize(model=model, model_parameters=model.parameters(),
                                config=ds_config(stage, args.micro, lowp))
    except (NotImplementedError, AssertionError, ValueError) as err:
        dist.destroy_process_group()
        return Result(name, note=f"n/a: {str(err)[:100]}")
    step = engine_step(engine, batches)

    ms, losses = time_steps(step, args.steps, args.warmup)
    r = Result(name, ms_per_step=ms, losses=losses)
    r.tokens_per_s = args.micro * args.seq / (ms / 1e3)
    r.peak_gib = peak_gib()
    breakdown = f", master+state {state_gib(engine):.2f} GiB" if system == "lightspeed" else ""
    r.note = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}{breakdown}"
    dist.destroy_process_group()
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--size", default="1.3b")
    ap.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--deepspeed", action="store_true", help="also run DeepSpeed's engine (must be importable)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, two steps")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # system:stage:lowp, run in a child
    args = ap.parse_args()
    if args.smoke:
        os.environ["LIGHTSPEED_ACCELERATOR"] = "cpu"
        args.device, args.size, args.micro, args.seq, args.steps, args.warmup = "cpu", "demo", 2, 32, 2, 1
    if args.one:
        system, stage, lowp = args.one.split(":")
        print("RESULT " + json.dumps(asdict(run_one(args, system, int(stage), lowp == "1"))), flush=True)
        return
    cfg = GPTConfig.preset(args.size, block_size=args.seq)
    with torch.device("meta"):
        num_params = GPT(cfg).num_params()
    hw = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"== {args.size}: {num_params / 1e6:.0f}M params, micro batch {args.micro} x seq {args.seq}, {hw}, "
          f"torch {torch.__version__}, world size 1, each run in a fresh process", flush=True)
    systems = ["lightspeed"] + (["deepspeed"] if args.deepspeed else [])
    runs = [(sy, st, lp) for st in args.stages for sy in systems for lp in (False, True)]
    passthrough = [a for a in sys.argv[1:] if a != "--deepspeed"]
    results = []
    for system, stage, lowp in runs:
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(29600 + len(results)))
        proc = subprocess.run([sys.executable, __file__, *passthrough, "--one", f"{system}:{stage}:{int(lowp)}"],
                              env=env, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            results.append(Result(f"{system} ZeRO-{stage} {'bf16' if lowp else 'fp32'} state",
                                  note=f"failed: {tail[:120]}"))
        else:
            results.append(Result(**json.loads(line[len("RESULT "):])))
        r = results[-1]  # as each run lands, so a run cut short still reports the finished ones
        print(f"  {r.name}: {r.ms_per_step:.1f} ms/step, peak {r.peak_gib:.2f} GiB  {r.note}", flush=True)
    print_table(results, f"lightspeed ZeRO-{args.stages[0]} fp32 state")


if __name__ == "__main__":
    main()
