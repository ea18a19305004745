"""One-bit compressed communication: convergence and bytes on the wire against Adam, and (--gpu) the
cost of the compression against an uncompressed all-reduce.

    python benchmarks/onebit.py [--world 4] [--steps 300] [--preset small] [--json out.json]
    torchrun --nproc-per-node 2 benchmarks/onebit.py --gpu [--numels 16777216 67108864]

CPU mode trains the demo task (examples/train_gpt.py's byte-level GPT on its Shakespeare text; by
default a smaller cut of the demo model) on `--world` gloo processes, once per optimizer with the
same data, schedule and seed: AdamW (the reference), 1-bit Adam, 0/1 Adam, LAMB and 1-bit LAMB.
Reported: the final validation loss (the mean over ranks of `--eval_batches` held-out batches each),
its gap to AdamW's (and 1-bit LAMB's to LAMB's), and the bytes each rank put on the wire per step
after the warm-up, counted by the collective objects.

--gpu mode (NCCL, one process per GPU): per buffer size, the time of pack_signs + unpack_signs, of
the whole OneBitAllReduce, and of an fp32 all-reduce of the same buffer (CUDA events, median of
`--iters`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
import lightspeed  # noqa: E402
from lightspeed.testing.run_world import run_world  # noqa: E402
from benchmarks.demo_task import PRESETS, train_demo  # noqa: E402


def optimizers(steps: int, lr: float, lamb_lr: float, local_step_scaler: int, local_step_clipper: int,
               weight_decay: float, var_freeze_step: int | None = None) -> dict[str, dict]:
    """The optimizer sections compared; the one-bit ones leave warm-up after 20% of the steps. LAMB's
    trust ratio makes each step move a tensor by about lr times its norm, hence its own learning rate."""
    warm = max(steps // 5, 1)
    common = {"lr": lr, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": weight_decay}
    lamb = {**common, "lr": lamb_lr}
    return {
        "AdamW": {"type": "AdamW", "params": common},
        "OneBitAdam": {"type": "OneBitAdam", "params": {**common, "freeze_step": warm}},
        "ZeroOneAdam": {"type": "ZeroOneAdam", "params": {**common, "var_freeze_step": var_freeze_step or warm,
                                                          "local_step_scaler": local_step_scaler,
                                                          "local_step_clipper": local_step_clipper}},
        "Lamb": {"type": "Lamb", "params": {**lamb, "bias_correction": False}},
        "OneBitLamb": {"type": "OneBitLamb", "params": {**lamb, "freeze_step": warm}},
    }


def _train_one(name: str, optimizer: dict, args_dict: dict, zero: dict | None = None) -> dict:
    """Train the demo task on lightspeed with `optimizer` (a config section) and `zero` (the
    zero_optimization section, ZeRO-0 by default); the mean validation loss over ranks and the bytes
    on the wire (benchmarks/demo_task.py's loop)."""
    return train_demo(lightspeed.initialize, name, optimizer, args_dict, zero)


def cpu_main(args) -> None:
    rows = []
    for name, opt in optimizers(args.steps, args.lr, args.lamb_lr, args.local_step_scaler,
                                args.local_step_clipper, args.weight_decay, args.var_freeze_step).items():
        if args.only and name not in args.only:
            continue
        row = run_world(_train_one, args.world, name, opt, vars(args), timeout=args.timeout)[0]
        rows.append(row)
        print(json.dumps(row), flush=True)
    by = {r["name"]: r for r in rows}
    print(f"\nworld {args.world}, {args.steps} steps, {rows[0]['params']:,} parameters (fp32, gloo)")
    print(f"{'optimizer':<12} {'val loss':>9} {'vs AdamW':>9} {'bytes/step':>11} {'AdamW/this':>10}")
    for r in rows:
        ref = by.get("AdamW")
        gap = (r["val_loss"] / ref["val_loss"] - 1) * 100 if ref else math.nan
        ratio = ref["bytes_per_step_after_warmup"] / r["bytes_per_step_after_warmup"] if ref else math.nan
        print(f"{r['name']:<12} {r['val_loss']:>9.4f} {gap:>+8.2f}% {r['bytes_per_step_after_warmup']:>11.0f} "
              f"{ratio:>9.1f}x")
    if "Lamb" in by and "OneBitLamb" in by:
        print(f"OneBitLamb vs Lamb: {(by['OneBitLamb']['val_loss'] / by['Lamb']['val_loss'] - 1) * 100:+.2f}%")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def gpu_main(args) -> None:
    from lightspeed.comm.collectives import Communicator
    from lightspeed.comm.onebit import OneBitAllReduce
    from lightspeed.ops.onebit import pack_signs, unpack_signs

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    comm = Communicator()
    codec = OneBitAllReduce(comm)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]

    for n in args.numels:
        x = torch.randn(n, device="cuda")
        packed = pack_signs(x)
        scales = torch.rand(n // codec.block, device="cuda")
        worker, server = codec.error_buffers(n, "cuda")
        t_pack = timed(lambda: pack_signs(x))
        t_unpack = timed(lambda: unpack_signs(packed, n, scales, codec.block))
        # at world size 1 the codec sends nothing and returns its input: there is nothing to time
        t_onebit = timed(lambda: codec(x.clone(), worker, server)) if comm.world_size > 1 else None
        t_exact = timed(lambda: dist.all_reduce(x))
        if rank == 0:
            print(json.dumps({"numel": n, "world": comm.world_size, "pack_ms": t_pack, "unpack_ms": t_unpack,
                              "onebit_all_reduce_ms": t_onebit, "fp32_all_reduce_ms": t_exact,
                              "onebit_wire_bytes": codec.wire_bytes(n), "fp32_bytes": 4 * n}), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="time the compression on GPUs (run under torchrun)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lamb_lr", type=float, default=2e-2)
    p.add_argument("--var_freeze_step", type=int, default=None, help="0/1 Adam's (default: 20%% of the steps)")
    p.add_argument("--weight_decay", type=float, default=0.1, help="examples/ds_config.json's")
    p.add_argument("--local_step_scaler", type=int, default=32678, help="0/1 Adam's (DeepSpeed's default)")
    p.add_argument("--local_step_clipper", type=int, default=16, help="0/1 Adam's (DeepSpeed's default)")
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--eval_batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--only", nargs="*", default=None, help="run only these optimizers")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", default=None)
    p.add_argument("--numels", type=int, nargs="*", default=[1 << 22, 1 << 24, 1 << 26])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    gpu_main(args) if args.gpu else cpu_main(args)


if __name__ == "__main__":
    main()
