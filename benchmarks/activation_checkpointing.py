"""Activation checkpointing on one GPU: peak memory and step time of a GPT trained through the
engine with every block run through `lightspeed.checkpointing.checkpoint` (reentrant, DeepSpeed's),
`non_reentrant_checkpoint`, `checkpoint` with `cpu_checkpointing`, and torch.utils.checkpoint, against
the same model without checkpointing, measured in the same run; then (--max-seq) the longest sequence
that trains at micro batch 1 without checkpointing and with checkpoint + cpu_checkpointing.

Claim: checkpointing each block keeps only the blocks' inputs (cpu_checkpointing: keeps them in host
memory), so peak activation memory drops from O(layers x per-layer activations) to O(layers x input +
one layer's activations), at the cost of one extra forward (~1.33x step time).

    python benchmarks/activation_checkpointing.py [--size 1.3b] [--micro 8] [--seq 2048] [--stage 0]
        [--steps 10] [--max-seq [--skip-table]] [--smoke]

The position embedding is frozen in every run (see `run_one`). Each max-seq probe starts a process and
builds the model (~20 s at 1.3B): run the search separately, e.g. `--max-seq --skip-table --seq 16384`.

Each configuration runs in a fresh process (world size 1), so none inherits another's allocator state.
bf16 parameters with fp32 master weights and AdamW (DeepSpeed's bf16 semantics). --smoke: a tiny
model on the CPU (times only), to keep the script alive.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lightspeed  # noqa: E402
from benchmarks.harness import Result, engine_step, peak_gib, reset_memory, time_steps  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from lightspeed import checkpointing  # noqa: E402

MODES = {  # name -> (block wrapper kind, cpu_checkpointing)
    "none": (None, False),
    "checkpoint": ("reentrant", False),
    "non_reentrant": ("non_reentrant", False),
    "checkpoint+cpu": ("reentrant", True),
    "torch.utils.checkpoint": ("torch", False),
}
BASELINE = "none"


class Checkpointed(torch.nn.Module):
    """Runs `block` through one of the checkpoint functions."""

    def __init__(self, block: torch.nn.Module, kind: str):
        super().__init__()
        self.block, self.kind = block, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "reentrant":
            return checkpointing.checkpoint(self.block, x)
        if self.kind == "non_reentrant":
            return checkpointing.non_reentrant_checkpoint(self.block, x)
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def config(args, cpu_checkpointing: bool, micro: int) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": args.stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}}}
    if torch.cuda.is_available() and not args.smoke:
        cfg["bf16"] = {"enabled": True}
    if cpu_checkpointing:
        cfg["activation_checkpointing"] = {"cpu_checkpointing": True}  # the engine configures checkpoint()
    return cfg


def run_one(args, mode: str, micro: int, seq: int) -> Result:
    """One configuration in this process: `args.steps` timed steps (max-seq probes: one step)."""
    lightspeed.init_distributed(verbose=False)
    kind, cpu = MODES[mode]
    torch.manual_seed(0)
    cfg = GPTConfig.preset(args.size, block_size=seq)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not args.smoke \
        else torch.device("cpu")
    with device:
        model = GPT(cfg)
    # a learned position table grows with the sequence (1M positions x 2048 = 2B parameters): frozen, it
    # costs its bf16 copy only, so the long-sequence probes measure activations
    model.wpe.weight.requires_grad_(False)
    if kind is not None:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = Checkpointed(block, kind)
    reset_memory()
    engine, *_ = lightspeed.initialize(model=model, config=config(args, cpu, micro))
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g).to(engine.device) for _ in range(2)]
    step = engine_step(engine, batches)

    probe = args.probe
    ms, losses = time_steps(step, 1 if probe else args.steps, 0 if probe else args.warmup)
    r = Result(mode, ms_per_step=ms, tokens_per_s=micro * seq / (ms / 1e3), peak_gib=peak_gib(), losses=losses)
    r.note = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    return r


def child(args, mode: str, micro: int, seq: int, probe: bool = False) -> Result:
    """Run one configuration in a fresh process; an out-of-memory or other failure becomes a note."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29500 + (hash((mode, micro, seq)) % 1000)))
    cmd = [sys.executable, __file__, "--size", args.size, "--stage", str(args.stage), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--one", f"{mode}:{micro}:{seq}"] + (["--smoke"] if args.smoke else []) \
        + (["--probe"] if probe else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        err = proc.stderr.strip().splitlines() or ["no output"]
        oom = any("OutOfMemoryError" in ln or "out of memory" in ln for ln in err)
        return Result(mode, note="out of memory" if oom else f"failed: {err[-1][:120]}")
    return Result(**json.loads(line[len("RESULT "):]))


def print_table(results: list[Result]) -> None:
    base = next(r for r in results if r.name == BASELINE)
    print(f"{'run':<24}{'ms/step':>10}{'time x':>8}{'tokens/s':>12}{'peak GiB':>10}{'memory x':>10}  note")
    for r in results:
        t = r.ms_per_step / base.ms_per_step if base.ms_per_step == base.ms_per_step else float("nan")
        m = r.peak_gib / base.peak_gib if base.peak_gib == base.peak_gib else float("nan")
        print(f"{r.name:<24}{r.ms_per_step:>10.1f}{t:>8.2f}{r.tokens_per_s:>12.0f}{r.peak_gib:>10.2f}{m:>10.2f}"
              f"  {r.note}")


def longest(args, mode: str, start: int) -> int:
    """The longest sequence (a multiple of `start`'s granularity) one micro-batch-1 step trains at."""
    grain = max(start // 4, 64)
    ok, seq = 0, start
    while True:  # double until it fails
        r = child(args, mode, 1, seq, probe=True)
        print(f"  {mode:<16} seq {seq:>8}: {'ok' if not r.note.startswith(('out', 'failed')) else r.note}",
              flush=True)
        if r.note.startswith(("out", "failed")):
            break
        ok, seq = seq, seq * 2
        if seq > args.max_seq_limit:
            return ok
    lo, hi = ok, seq
    while hi - lo > grain:
        mid = (lo + hi) // 2 // grain * grain
        r = child(args, mode, 1, mid, probe=True)
        fits = not r.note.startswith(("out", "failed"))
        print(f"  {mode:<16} seq {mid:>8}: {'ok' if fits else r.note}", flush=True)
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1.3b")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--max-seq", action="store_true", help="also search the longest trainable sequence")
    ap.add_argument("--max-seq-limit", type=int, default=1 << 20)
    ap.add_argument("--skip-table", action="store_true", help="only the --max-seq search (from --seq on)")
    ap.add_argument("--max-seq-modes", default=f"{BASELINE},checkpoint+cpu", help="the modes --max-seq searches")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # mode:micro:seq, run in a child
    args = ap.parse_args()
    if args.smoke:
        os.environ["LIGHTSPEED_ACCELERATOR"] = "cpu"
        args.size, args.micro, args.seq, args.steps, args.warmup, args.max_seq_limit = "demo", 2, 32, 2, 1, 128
    if args.one:
        mode, micro, seq = args.one.split(":")
        print("RESULT " + json.dumps(asdict(run_one(args, mode, int(micro), int(seq)))), flush=True)
        return
    with torch.device("meta"):
        num_params = GPT(GPTConfig.preset(args.size, block_size=args.seq)).num_params()
    hw = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu"
    print(f"== {args.size}: {num_params / 1e6:.0f}M params, ZeRO-{args.stage}, micro batch {args.micro} x seq "
          f"{args.seq}, {hw}, torch {torch.__version__}, each run in a fresh process", flush=True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if BASELINE not in modes:
        modes.insert(0, BASELINE)
    if not args.skip_table:
        print_table([child(args, m, args.micro, args.seq) for m in modes])
    if args.max_seq:
        print("\n== longest sequence at micro batch 1 (one full step; granularity seq/4)", flush=True)
        found = {m: longest(args, m, args.seq) for m in args.max_seq_modes.split(",") if m.strip()}
        base = found.get(BASELINE)
        for m, seq in found.items():
            print(f"{m:<24}{seq:>10} tokens{seq / base if base else float('nan'):>8.2f}x")


if __name__ == "__main__":
    main()
