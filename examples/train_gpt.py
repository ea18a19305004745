"""Train a small byte-level GPT on Shakespeare with lightspeed, written the way a DeepSpeed script is.

Run it through a launcher that sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT:

    lightspeed demo                                        # 2 CPU processes, ~1.5 minutes
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 300

Everything distributed-training specific is in the four calls DeepSpeed users know:
``initialize`` (model, optimizer, scheduler and a sharded DataLoader from one JSON config), then
``engine(x, y)``, ``engine.backward(loss)`` and ``engine.step()``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

# Without NumPy (not a dependency: nothing here uses it) torch warns at import, once per process.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lightspeed  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # gpt.py and data.py sit beside this script

from data import ByteTokenizer, train_val_datasets  # noqa: E402
from gpt import GPT, PRESETS, GPTConfig  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(HERE / "ds_config.json"), help="DeepSpeed-style JSON config")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: the scheduler's total_num_steps in the config)")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="model size (see examples/gpt.py)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log_interval", type=int, default=100, help="print the averaged train loss every N steps")
    p.add_argument("--eval_batches", type=int, default=20, help="validation batches per rank at the end")
    p.add_argument("--prompt", default="Romeo.\n", help="text to continue at the end (speakers look like 'Romeo.')")
    p.add_argument("--gen_bytes", type=int, default=200)
    p.add_argument("--save_dir", default=None, help="if set, engine.save_checkpoint(save_dir) at the end")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="accepted for DeepSpeed-launcher compatibility; LOCAL_RANK is what is used")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> dict:
    """The JSON config, with the schedule stretched to --steps and bf16 turned on where CUDA has it."""
    with open(args.config) as f:
        config = json.load(f)
    sched = config.get("scheduler", {}).get("params", {})
    if args.steps is None:
        args.steps = int(sched.get("total_num_steps", 300))
    elif "total_num_steps" in sched:
        sched["total_num_steps"] = args.steps
        if "warmup_num_steps" in sched:
            sched["warmup_num_steps"] = min(sched["warmup_num_steps"], max(1, args.steps // 10))
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        config.setdefault("bf16", {"enabled": True})
    # this script prints the train loss (averaged over the ranks) every --log_interval steps, so the
    # engine's own step line would say the same thing again
    config["steps_per_print"] = None
    return config


def mean_over_ranks(total: float, count: int) -> float:
    """Mean of per-rank sums: all_reduce of (sum, count); every rank must call it."""
    t = torch.tensor([total, float(count)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
    return (t[0] / t[1].clamp(min=1)).item()


@torch.no_grad()
def evaluate(engine, val_dataset, batch_size: int, num_batches: int, rank: int, world_size: int) -> float:
    """Mean loss over this rank's share (every world_size-th window) of the first validation windows."""
    engine.eval()
    indices = list(range(rank, len(val_dataset), world_size))[: batch_size * num_batches]
    total, count = 0.0, 0
    for i in range(0, len(indices), batch_size):
        xs, ys = zip(*(val_dataset[j] for j in indices[i : i + batch_size]))
        x, y = torch.stack(xs).to(engine.device), torch.stack(ys).to(engine.device)
        total += engine(x, y).item() * len(xs)
        count += len(xs)
    engine.train()
    return mean_over_ranks(total, count)


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    lightspeed.init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    config = load_config(args)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model_config = GPTConfig.preset(args.preset)
    model = GPT(model_config)
    num_params = model.num_params()  # before initialize(): a sharding engine may partition the weights
    train_dataset, val_dataset = train_val_datasets(model_config.block_size)

    engine, optimizer, train_loader, lr_scheduler = lightspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=train_dataset, config=config
    )

    micro_batch = engine.train_micro_batch_size_per_gpu()
    tokens_per_step = micro_batch * engine.gradient_accumulation_steps() * world_size * model_config.block_size
    log(f"GPT '{args.preset}': {num_params / 1e6:.2f}M parameters, {model_config.n_layer} layers, "
        f"context {model_config.block_size} bytes | {world_size} process(es) on {engine.device} | "
        f"{args.steps} steps x {tokens_per_step} tokens | {len(train_dataset)} training windows")
    log(f"the first step's loss (before any update) should be about ln(256) = {math.log(256):.2f}")

    engine.train()
    loss_sum, loss_count, epoch, last_logged = 0.0, 0, 0, 0
    interval_start = loop_start = time.perf_counter()
    while engine.global_steps < args.steps:
        sampler = getattr(train_loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # a fresh shuffle each pass over the data
        for x, y in train_loader:
            x, y = x.to(engine.device), y.to(engine.device)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss_sum, loss_count = loss_sum + loss.item(), loss_count + 1
            if not engine.is_gradient_accumulation_boundary():
                continue
            step = engine.global_steps
            if step == 1 or step % args.log_interval == 0 or step == args.steps:
                train_loss = mean_over_ranks(loss_sum, loss_count)
                ms_per_step = 1000 * (time.perf_counter() - interval_start) / (step - last_logged)
                eta = f" | eta {(args.steps - step) * ms_per_step / 1000:.0f} s" if step < args.steps else ""
                log(f"step {step:5d}/{args.steps} | train loss {train_loss:.4f} | "
                    f"lr {engine.get_lr()[0]:.2e} | {ms_per_step:6.1f} ms/step{eta}")
                loss_sum, loss_count, last_logged, interval_start = 0.0, 0, step, time.perf_counter()
            if step >= args.steps:
                break
        epoch += 1
    train_seconds = time.perf_counter() - loop_start

    val_loss = evaluate(engine, val_dataset, micro_batch, args.eval_batches, rank, world_size)
    log(f"val loss {val_loss:.4f} (perplexity {math.exp(val_loss):.2f} per byte) | trained {train_seconds:.1f} s, "
        f"{args.steps * tokens_per_step / train_seconds:,.0f} tokens/s")

    # Every rank generates (a sharded engine may need all of them in each forward); rank 0 prints.
    tokenizer = ByteTokenizer()
    torch.manual_seed(args.seed)
    prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long, device=engine.device)
    engine.eval()
    out = engine.module.generate(prompt, args.gen_bytes, temperature=0.8, top_k=40)
    engine.train()
    log("--- sample ---\n" + tokenizer.decode(out[0]) + "\n--------------")

    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
        log(f"checkpoint saved to {args.save_dir}")
    log(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
