"""Offload on one GPU (NCCL, world size 1): every offload variant against the same run without it.

Trains the example GPT on a learnable token pattern for a few steps per (precision, stage, variant)
and prints the largest relative loss difference to the run without offload, ms/step and peak GPU
memory. A functional check of the CUDA paths (pinned host buffers, side-stream copies, NCCL with
host-resident shards, NVMe swapping), not a speed claim: benchmarks/offload.py measures speed.

    python benchmarks/offload_gpu_check.py [--preset gpt2] [--steps 8] [--nvme-path DIR]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightspeed  # noqa: E402
from benchmarks.engine_gpu_check import batches  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402


def variants(stage: int, nvme: str) -> dict[str, dict]:
    out = {"none": {}, "cpu": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
           "cpu-overlap": {"offload_optimizer": {"device": "cpu", "pin_memory": True, "overlap_step": True}},
           "nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    if stage == 3:
        out["cpu-param"] = {"offload_optimizer": {"device": "cpu", "pin_memory": True},
                            "offload_param": {"device": "cpu", "pin_memory": True}}
        out["param-only"] = {"offload_param": {"device": "cpu", "pin_memory": True}}
        out["nvme-param"] = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                             "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}}
    return out


def run(base: GPT, data, precision: str, stage: int, zero: dict, steps: int):
    model = copy.deepcopy(base)
    cfg = {"train_micro_batch_size_per_gpu": data[0][0].shape[0], "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    torch.cuda.reset_peak_memory_stats()
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses, start = [], None
    for i in range(steps):
        if i == 2:
            torch.cuda.synchronize()
            start = time.perf_counter()
        x, y = data[i]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3 / (steps - 2)
    mem = engine.memory_breakdown()
    del engine, model
    return losses, ms, torch.cuda.max_memory_allocated() / 2**30, mem


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--nvme-path", default=None)
    args = ap.parse_args()
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533").items():
        os.environ.setdefault(k, v)
    lightspeed.init_distributed(verbose=False)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    cfg = GPTConfig.preset(args.preset, block_size=256)
    base = GPT(cfg).to(device)
    data = batches(cfg, 8, args.steps, device)
    nvme = args.nvme_path or tempfile.mkdtemp(prefix="offload-check-")
    print(f"{args.preset}: {base.num_params() / 1e6:.0f}M params, {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, nvme_path {nvme}")
    print(f"{'precision':<10}{'stage':>6}  {'variant':<12}{'max rel diff':>14}{'ms/step':>10}{'peak GiB':>10}  breakdown")
    for precision in ("fp32", "bf16"):
        for stage in (1, 2, 3):
            ref = None
            for name, zero in variants(stage, nvme).items():
                try:
                    losses, ms, peak, mem = run(base, data, precision, stage, zero, args.steps)
                except Exception as err:  # a failing variant is reported, the others still run
                    print(f"{precision:<10}{stage:>6}  {name:<12} FAILED: {type(err).__name__}: {err}")
                    continue
                if ref is None:
                    ref = losses
                diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
                brief = "; ".join(f"{d}: " + ", ".join(f"{k} {v / 2**20:.0f}M" for k, v in sorted(c.items()))
                                  for d, c in mem.items())
                print(f"{precision:<10}{stage:>6}  {name:<12}{diff:>14.2e}{ms:>10.1f}{peak:>10.2f}  {brief}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
