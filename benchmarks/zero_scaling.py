"""ZeRO scaling over several GPUs of one host: lightspeed stages 1-3 against DeepSpeed's engine and
PyTorch FSDP2 (`fully_shard`) on the same model, batch per GPU and precision, in the same run.

    python benchmarks/zero_scaling.py [--sizes 1.3b] [--worlds 1 2] [--stages 1 2 3] [--micro 4]
        [--seq 2048] [--steps 10] [--deepspeed] [--fsdp2] [--check] [--smoke]

Each configuration runs as its own torchrun job (NCCL on GPUs, gloo with --smoke). Reported per
run: ms/step, tokens/s per GPU, scaling efficiency against the same system at world size 1, peak
memory per GPU, and (lightspeed) communication bytes per step counted by its comm layer.
--check first trains a small GPT for 10 steps at every stage on the largest world size and prints
the loss trajectory of stages 1-3 against stage 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightspeed  # noqa: E402
from benchmarks.harness import H200_BF16_PEAK_FLOPS, peak_gib, reset_memory, time_steps  # noqa: E402
from benchmarks.zero_step import ds_config, make_batches  # noqa: E402
from examples.gpt import GPT, Block, GPTConfig  # noqa: E402


@dataclass
class Row:
    name: str
    world: int
    ms_per_step: float = float("nan")
    tokens_per_s_per_gpu: float = float("nan")
    mfu: float = float("nan")
    peak_gib: float = float("nan")
    comm_bytes_per_step: float = float("nan")
    note: str = ""


def device_of() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def run_one(args, size: str, system: str, stage: int) -> Row:
    lightspeed.init_distributed(verbose=False)
    world, device = dist.get_world_size(), device_of()
    torch.manual_seed(0)
    cfg = GPTConfig.preset(size, block_size=args.seq)
    with device:
        base = GPT(cfg)
    batches = make_batches(cfg.vocab_size, args.micro, args.seq, device)
    rank = dist.get_rank()
    batches = batches[rank:] + batches[:rank]  # every rank its own data
    reset_memory()
    row = Row(f"{system} " + (f"ZeRO-{stage}" if system != "fsdp2" else ("reshard" if stage == 3 else "no-reshard")),
              world)
    it = iter(range(10**9))
    comm = None
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = copy.deepcopy(base)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for m in model.modules():
            if isinstance(m, Block):
                fully_shard(m, mp_policy=mp, reshard_after_forward=stage == 3)
        fully_shard(model, mp_policy=mp, reshard_after_forward=stage == 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

        def step():
            b = batches[next(it) % len(batches)]
            loss = model(b[:, :-1], b[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    else:
        init = lightspeed.initialize
        if system == "deepspeed":
            import deepspeed

            init = deepspeed.initialize
        model = copy.deepcopy(base)
        del base
        engine, *_ = init(model=model, model_parameters=model.parameters(),
                          config=ds_config(stage, args.micro, device.type == "cuda", torch_adam=False))
        comm = getattr(engine, "comm", None) if system == "lightspeed" else None

        def step():
            b = batches[next(it) % len(batches)]
            loss = engine(b[:, :-1].to(device), b[:, 1:].to(device))
            engine.backward(loss)
            engine.step()
            return loss.detach()

    for _ in range(args.warmup):
        step()
    if comm is not None:
        comm.stats.reset()
    ms, _ = time_steps(step, args.steps, 0)
    row.ms_per_step = ms
    row.tokens_per_s_per_gpu = args.micro * args.seq / (ms / 1e3)
    with torch.device("meta"):
        flops = GPT(cfg).flops_per_token(args.seq)
    row.mfu = flops * row.tokens_per_s_per_gpu / H200_BF16_PEAK_FLOPS
    row.peak_gib = peak_gib()
    if comm is not None:
        row.comm_bytes_per_step = comm.stats.total_bytes() / args.steps
    dist.destroy_process_group()
    return row


def check_losses(args) -> dict:
    """Small GPT, 10 steps at every stage on this world: every rank's mean loss per step."""
    lightspeed.init_distributed(verbose=False)
    device, rank, world = device_of(), dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("gpt2", n_layer=4, n_embd=256, n_head=4, block_size=256))
        cfg = ds_config(stage, 4, device.type == "cuda", torch_adam=False)
        cfg["zero_optimization"]["reduce_bucket_size"] = 2_000_000  # several buckets
        engine, *_ = lightspeed.initialize(model=model, config=cfg)
        g = torch.Generator().manual_seed(1)
        data = torch.randint(0, 50304, (10, 4 * world, 257), generator=g)
        losses = []
        for s in range(10):
            b = data[s, rank * 4:(rank + 1) * 4].to(device)
            loss = engine(b[:, :-1], b[:, 1:])
            engine.backward(loss)
            engine.step()
            t = loss.detach().float().clone()
            dist.all_reduce(t)
            losses.append(t.item() / world)
        out[stage] = losses
        del engine, model
        reset_memory()
    dist.destroy_process_group()
    return out


def torchrun(world: int, argv: list[str], port: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={port}",
           __file__, *argv]
    return subprocess.run(cmd, capture_output=True, text=True)


def result_line(proc) -> dict | None:
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return json.loads(line[len("RESULT "):]) if line else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["1.3b"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deepspeed", action="store_true")
    ap.add_argument("--fsdp2", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU with gloo")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--check-one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        os.environ["LIGHTSPEED_ACCELERATOR"] = "cpu"
        args.sizes, args.micro, args.seq, args.steps, args.warmup = ["demo"], 2, 32, 2, 1
    if args.one:
        size, system, stage = args.one.split(":")
        row = run_one(args, size, system, int(stage))
        if int(os.environ.get("RANK", 0)) == 0:
            print("RESULT " + json.dumps(asdict(row)), flush=True)
        return
    if args.check_one:
        out = check_losses(args)
        if int(os.environ.get("RANK", 0)) == 0:
            print("RESULT " + json.dumps(out), flush=True)
        return
    base_argv = [a for a in sys.argv[1:] if a not in ("--deepspeed", "--fsdp2", "--check")]
    port = 29600
    if args.check:
        world = max(args.worlds)
        res = result_line(torchrun(world, base_argv + ["--check-one"], port))
        print(f"\n== loss trajectories at world size {world} (small GPT, bf16 on GPU, 10 steps)")
        if res is None:
            print("check failed to run")
        else:
            ref = res["0"]
            for stage in ("0", "1", "2", "3"):
                worst = max(abs(a - b) / abs(b) for a, b in zip(res[stage], ref))
                print(f"stage {stage}: " + " ".join(f"{x:.4f}" for x in res[stage]) + f"  max rel diff {worst:.2e}")
    systems = [("lightspeed", s) for s in args.stages]
    systems += [("deepspeed", s) for s in args.stages] if args.deepspeed else []
    systems += [("fsdp2", 2), ("fsdp2", 3)] if args.fsdp2 else []
    for size in args.sizes:
        print(f"\n== {size}, micro batch {args.micro} x seq {args.seq} per GPU, bf16, worlds {args.worlds}")
        print(f"{'run':<26}{'world':>6}{'ms/step':>10}{'tok/s/GPU':>11}{'eff':>6}{'MFU':>7}{'peak GiB':>10}"
              f"{'comm MiB/step':>15}  note")
        single: dict[str, float] = {}
        for system, stage in systems:
            for world in args.worlds:
                port += 1
                proc = torchrun(world, base_argv + ["--one", f"{size}:{system}:{stage}"], port)
                res = result_line(proc)
                if res is None:
                    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:100]
                    print(f"{system + ' ' + str(stage):<26}{world:>6}  failed: {tail}", flush=True)
                    continue
                row = Row(**res)
                if world == 1:
                    single[row.name] = row.tokens_per_s_per_gpu
                eff = row.tokens_per_s_per_gpu / single[row.name] if row.name in single else float("nan")
                print(f"{row.name:<26}{world:>6}{row.ms_per_step:>10.1f}{row.tokens_per_s_per_gpu:>11.0f}{eff:>6.2f}"
                      f"{row.mfu:>7.3f}{row.peak_gib:>10.2f}{row.comm_bytes_per_step / 2**20:>15.1f}  {row.note}",
                      flush=True)


if __name__ == "__main__":
    main()
