"""ZeRO++ on one GPU: the cost of the int8 block quantization against an all-gather of the same buffer,
and the memory a LoRA-style frozen base saves with zero_quantized_nontrainable_weights.

    python benchmarks/zeropp.py [--hidden 2048] [--layers 24] [--iters 20] [--lora_layers 12] [--json out.json]
    python benchmarks/zeropp.py --smoke      # tiny sizes on CPU, keeps the script alive

Part 1 (world size 1, NCCL): the flat bf16 buffers of a 1.3B-parameter GPT shape (24 blocks of
hidden 2048: one block's 50M-element group, and all 1.3B elements at once). Per buffer, median of
`--iters` (CUDA events): `quantize` (bf16 -> int8 codes + one fp32 scale per 4096 elements, the qwZ
wire format), `dequantize` (back to bf16, what every rank does on arrival), and NCCL all-gathers of
the bf16 buffer and of the int8 codes at world size 1 (a device copy: the floor of any all-gather;
across ranks the wire time scales with the bytes, which int8 halves against bf16).

Part 2: a frozen bf16 base (`--lora_layers` blocks of hidden `--hidden`, 4 h x h projections and an
h x 4h / 4h x h MLP each) with trainable rank-16 LoRA adapters, trained for a few steps by the ZeRO-3
engine with and without zero_quantized_nontrainable_weights, each in a fresh process: the frozen
shard's bytes (the engine's memory breakdown), peak GPU memory, ms per step and the last loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import lightspeed  # noqa: E402
from benchmarks.harness import peak_gib, reset_memory, sync, time_steps  # noqa: E402
from lightspeed.comm.quantized import WEIGHT_BITS, WEIGHT_BLOCK  # noqa: E402
from lightspeed.ops.quantize import dequantize, quantize  # noqa: E402


def _init_world(backend: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not dist.is_initialized():
        dist.init_process_group(backend)


def _median_ms(fn, iters: int, device: str) -> float:
    for _ in range(3):
        fn()
    if device != "cuda":
        import time

        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def codec_part(args, device: str) -> list[dict]:
    _init_world("nccl" if device == "cuda" else "gloo")
    h, layers = args.hidden, args.layers
    block_numel = 12 * h * h + 13 * h  # attention (4 h x h) + MLP (h x 4h, 4h x h), biases and two norms
    total = layers * block_numel + 50304 * h  # + the tied embedding
    rows = []
    buffers = ((f"one block ({block_numel / 1e6:.1f}M)", block_numel), (f"whole model ({total / 1e9:.2f}B)", total))
    for name, n in buffers:
        x = torch.randn(n, device=device, dtype=torch.bfloat16)
        codes, scales = quantize(x, WEIGHT_BITS, WEIGHT_BLOCK)
        out = torch.empty_like(x)
        gathered_bf16 = torch.empty_like(x)
        gathered_int8 = torch.empty_like(codes)
        row = {"buffer": name, "numel": n,
               "quantize_ms": _median_ms(lambda: quantize(x, WEIGHT_BITS, WEIGHT_BLOCK), args.iters, device),
               "dequantize_ms": _median_ms(lambda: dequantize(codes, scales, n, WEIGHT_BITS, WEIGHT_BLOCK, out=out),
                                           args.iters, device),
               "all_gather_bf16_ms": _median_ms(lambda: dist.all_gather_into_tensor(gathered_bf16, x), args.iters,
                                                device),
               "all_gather_int8_ms": _median_ms(lambda: dist.all_gather_into_tensor(gathered_int8, codes), args.iters,
                                                device),
               "bf16_bytes": 2 * n, "int8_wire_bytes": codes.numel() + 4 * scales.numel()}
        err = (dequantize(codes, scales, n, WEIGHT_BITS, WEIGHT_BLOCK, torch.float32) - x.float()).abs().max()
        row["max_abs_error"] = float(err)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del x, codes, scales, out, gathered_bf16, gathered_int8
        reset_memory()
    return rows


class LoRALinear(torch.nn.Module):
    def __init__(self, fan_in: int, fan_out: int, rank: int = 16):
        super().__init__()
        self.base = torch.nn.Linear(fan_in, fan_out, bias=False)
        self.base.weight.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, fan_in) / fan_in ** 0.5)
        self.b = torch.nn.Parameter(torch.zeros(fan_out, rank))

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class LoRABlock(torch.nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.norm.requires_grad_(False)
        self.q, self.k, self.v, self.o = (LoRALinear(h, h) for _ in range(4))
        self.up, self.down = LoRALinear(h, 4 * h), LoRALinear(4 * h, h)

    def forward(self, x):
        y = self.norm(x)
        attn = torch.softmax(self.q(y) @ self.k(y).transpose(-1, -2) / y.shape[-1] ** 0.5, dim=-1) @ self.v(y)
        x = x + self.o(attn)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class LoRAModel(torch.nn.Module):
    def __init__(self, h: int, layers: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(LoRABlock(h) for _ in range(layers))

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.mse_loss(x.float(), y.float())


def lora_one(args, quantized: bool, device: str) -> dict:
    _init_world("nccl" if device == "cuda" else "gloo")
    torch.manual_seed(0)
    with torch.device(device):
        model = LoRAModel(args.hidden, args.lora_layers).to(torch.bfloat16)
    config = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": quantized}}
    reset_memory()
    engine, *_ = lightspeed.initialize(model=model, config=config)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(args.micro, args.seq, args.hidden, device=device, generator=g, dtype=torch.bfloat16)
    y = torch.randn(x.shape, device=device, generator=g, dtype=torch.bfloat16)

    def step():
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    ms, losses = time_steps(step, args.steps, warmup=2)
    sync()
    breakdown = engine.memory_breakdown()
    frozen = sum(p.ds_numel for p in model.parameters() if not p.requires_grad)
    return {"run": "int8 frozen shard" if quantized else "bf16 frozen shard", "frozen_params": frozen,
            "lp_params_bytes": sum(b.get("lp_params", 0) for b in breakdown.values()),
            "peak_gib": peak_gib(), "ms_per_step": ms, "last_loss": losses[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24, help="blocks of the 1.3B shape (part 1)")
    ap.add_argument("--lora_layers", type=int, default=12, help="blocks of the frozen base (part 2)")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "lora:0|1", run in a child
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        os.environ["LIGHTSPEED_ACCELERATOR"] = "cpu"
        args.hidden, args.layers, args.lora_layers, args.micro, args.seq, args.steps, args.iters = 64, 2, 2, 2, 8, 2, 3
    if args.one:
        print("RESULT " + json.dumps(lora_one(args, args.one.endswith("1"), device)), flush=True)
        return
    hw = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"== ZeRO++ int8 weight wire format, {hw}, torch {torch.__version__}, world size 1", flush=True)
    out = {"codec": [], "lora": []}
    out["codec"] = codec_part(args, device)
    dist.destroy_process_group()
    print(f"{'buffer':<26}{'quantize ms':>12}{'dequant ms':>11}{'AG bf16 ms':>11}{'AG int8 ms':>11}{'max err':>9}")
    for r in out["codec"]:
        print(f"{r['buffer']:<26}{r['quantize_ms']:>12.3f}{r['dequantize_ms']:>11.3f}{r['all_gather_bf16_ms']:>11.3f}"
              f"{r['all_gather_int8_ms']:>11.3f}{r['max_abs_error']:>9.4f}")
    print(f"\n== LoRA-style frozen base: {args.lora_layers} blocks of hidden {args.hidden}, rank-16 adapters, ZeRO-3 "
          f"bf16, micro {args.micro} x seq {args.seq}, each run in a fresh process", flush=True)
    for i, quantized in enumerate((False, True)):
        env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(29540 + i))
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", f"lora:{int(quantized)}"], env=env,
                              capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"run failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1][:300]}")
            continue
        out["lora"].append(json.loads(line[len("RESULT "):]))
    print(f"{'run':<20}{'frozen params':>14}{'lp_params MiB':>14}{'peak GiB':>10}{'ms/step':>9}{'last loss':>10}")
    for r in out["lora"]:
        print(f"{r['run']:<20}{r['frozen_params']:>14,}{r['lp_params_bytes'] / 2**20:>14.1f}{r['peak_gib']:>10.2f}"
              f"{r['ms_per_step']:>9.1f}{r['last_loss']:>10.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
