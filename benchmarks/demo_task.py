"""The demo task's training loop, shared by lightspeed's runs and real DeepSpeed's.

`train_demo` trains examples/train_gpt.py's byte-level GPT on its Shakespeare text (AdamW or the
given optimizer section, warm-up + cosine schedule, clipping 1.0) in an initialized process group,
with the engine that `initialize` (lightspeed.initialize or deepspeed.initialize) builds, and returns
the mean validation loss over ranks. Imports only torch and examples/ (gpt.py, data.py), so a
DeepSpeed child process (its own interpreter, benchmarks/offload_convergence.py --deepspeed) runs
the same model init, data order, schedule and clipping without importing lightspeed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))

PRESETS = {"small": dict(n_layer=2, n_head=4, n_embd=64, block_size=64), "demo": {}}


def demo_config(args, optimizer: dict, zero: dict | None) -> dict:
    """The engine config of every run: the schedule, clipping 1.0, `zero` (ZeRO-0 by default)."""
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9, "gradient_clipping": 1.0, "optimizer": optimizer,
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": args.steps,
                                                               "warmup_num_steps": max(args.steps // 10, 1),
                                                               "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
            "zero_optimization": zero or {"stage": 0}}


def train_demo(initialize, name: str, optimizer: dict, args_dict: dict, zero: dict | None = None,
               count_wire: bool = True, check_init: bool = False) -> dict:
    """Train the demo task with `optimizer` (a config section) and `zero` (the zero_optimization
    section) on the engine `initialize(model=, config=)` returns; the mean validation loss over
    ranks and, with `count_wire` (lightspeed's `engine.comm.stats`), the bytes on the wire. With
    `check_init`, also "init_max_diff": the largest change `initialize` made to the model's weights
    (0.0 when the run starts from the weights it was given)."""
    from data import train_val_datasets
    from gpt import GPT, GPTConfig

    args = argparse.Namespace(**args_dict)
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(args.seed)
    cfg = GPTConfig.preset("demo", **PRESETS[args.preset])
    model = GPT(cfg)
    if getattr(args, "init_from", None):  # a fine-tuning run starts from a trained model's weights
        model.load_state_dict(torch.load(args.init_from, weights_only=True))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()} if check_init else None
    engine, *_ = initialize(model=model, config=demo_config(args, optimizer, zero))
    init_diff = None
    if check_init:
        init_diff = max(((v.detach().float() - before[k].float()).abs().max().item() if v.numel() else 0.0)
                        for k, v in engine.module.state_dict().items())
    train, val = train_val_datasets(cfg.block_size)
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=g)
    part = getattr(args, "data_part", None)  # "first" / "second": only that half of the training text
    if part is not None:
        half = len(train) // 2
        order = order[order < half] if part == "first" else order[order >= half]
    warm = max(args.steps // 5, 1)
    wire, losses = [], []
    for step in range(args.steps):
        idx = order[(step * world + rank) * args.micro:(step * world + rank + 1) * args.micro] % len(train)
        x, y = map(torch.stack, zip(*(train[int(i)] for i in idx)))
        if count_wire:
            engine.comm.stats.reset()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if count_wire:
            wire.append(engine.comm.stats.total_bytes())
    engine.eval()
    if getattr(args, "save_to", None) and rank == 0:
        torch.save({k: v.detach().cpu() for k, v in engine.module.state_dict().items()}, args.save_to)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(args.eval_batches):
            start = ((b * world + rank) * args.micro) % max(len(val) - args.micro, 1)
            x, y = map(torch.stack, zip(*(val[i] for i in range(start, start + args.micro))))
            total += float(engine(x, y))
            count += 1
    t = torch.tensor([total, count], dtype=torch.float64)
    dist.all_reduce(t)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    row = {"name": name, "val_loss": float(t[0] / t[1]), "train_loss_last": sum(losses[-20:]) / 20, "params": numel}
    if check_init:
        row["init_max_diff"] = init_diff
    if count_wire:
        row.update(bytes_per_step_after_warmup=sum(wire[warm + 1:]) / max(len(wire) - warm - 1, 1),
                   bytes_first_step=wire[0])
    return row
