"""The engine on one GPU with NCCL at world size 1: fp32, fp16 (dynamic loss scaling) and bf16.

Trains the example GPT on random tokens for a few steps per precision through lightspeed.initialize,
and the same model with plain PyTorch (autocast + torch.optim.AdamW(fused=True)) in the same run, and
prints losses, ms/step and peak memory as a table. A functional check with context, not a speed claim.

    torchrun --nproc_per_node 1 benchmarks/engine_gpu_check.py [--preset gpt2] [--steps 30]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightspeed  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def batches(cfg: GPTConfig, batch: int, steps: int, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (steps, batch, cfg.block_size + 1), generator=g)
    # a learnable pattern: every token repeats the one 7 places back half of the time
    data[..., 7:] = torch.where(torch.rand(data[..., 7:].shape, generator=g) < 0.5, data[..., :-7], data[..., 7:])
    return [(d[:, :-1].to(device), d[:, 1:].to(device)) for d in data]


def run_engine(base: GPT, precision: str, data, steps: int):
    model = copy.deepcopy(base)
    cfg = {"train_micro_batch_size_per_gpu": data[0][0].shape[0], "gradient_clipping": 1.0, "steps_per_print": 10,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 0}}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return train(lambda x, y: engine(x, y), engine.backward, engine.step, data, steps, engine)


def run_plain(base: GPT, precision: str, data, steps: int):
    model = copy.deepcopy(base).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    dtype = DTYPES[precision]

    def fwd(x, y):
        with torch.autocast("cuda", dtype=dtype, enabled=precision != "fp32"):
            return model(x, y)

    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

    def step():
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return train(fwd, lambda loss: scaler.scale(loss).backward(), step, data, steps, None)


def train(fwd, backward, step, data, steps, engine):
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x, y = data[i % len(data)]
        loss = fwd(x, y)
        backward(loss)
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    warm = times[5:] or times
    extra = f" skipped={engine.skipped_steps} scale={engine.loss_scale:g}" if engine is not None else ""
    return losses, 1e3 * sum(warm) / len(warm), torch.cuda.max_memory_allocated() / 2**30, extra


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    lightspeed.init_distributed(dist_backend="nccl")
    assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
    torch.manual_seed(0)
    base = GPT(GPTConfig.preset(args.preset, block_size=args.seq))
    data = batches(base.config, args.batch, args.steps, "cuda")
    print(f"GPU {torch.cuda.get_device_name()} torch {torch.__version__} NCCL {torch.cuda.nccl.version()} "
          f"model {args.preset} {base.num_params() / 1e6:.0f}M params, batch {args.batch} x {args.seq}")
    print(f"{'run':<18}{'loss[0]':>9}{'loss[-1]':>10}{'ms/step':>10}{'vs plain':>10}{'peak GiB':>10}  notes")
    for precision in ("fp32", "fp16", "bf16"):
        p_losses, p_ms, p_mem, _ = run_plain(base, precision, data, args.steps)
        e_losses, e_ms, e_mem, extra = run_engine(base, precision, data, args.steps)
        print(f"{'plain ' + precision:<18}{p_losses[0]:>9.4f}{p_losses[-1]:>10.4f}{p_ms:>10.1f}{1.0:>10.2f}{p_mem:>10.2f}")
        print(f"{'lightspeed ' + precision:<18}{e_losses[0]:>9.4f}{e_losses[-1]:>10.4f}{e_ms:>10.1f}"
              f"{e_ms / p_ms:>10.2f}{e_mem:>10.2f} {extra}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
