"""How much do FP6 / INT8 / INT4 weights cost a *trained* model? (CPU)

Claim: FP6 weight-only quantization keeps a trained model's quality close to 16-bit weights,
INT8 closer still, per-channel INT4 visibly worse (per-group INT4 in between). The logits comparisons
elsewhere use randomly initialised models, whose near-flat logits say little about quality; here a
byte-level GPT (`examples/gpt.py`) is trained on the demo's Shakespeare for a while with plain
PyTorch AdamW, then every linear layer but the tied output head is quantized by
`lightspeed.init_inference(..., quant={"weight": fmt})` and evaluated on the held-out tenth of the text.

Baselines measured in the same run: the trained fp32 model itself, and its weights rounded to fp16
and bf16 (the 16-bit weights quantization is compared against). Columns: validation loss in bits per
byte (and its change against fp32), the logits' relative L2 error against fp32, and how often the
most likely next byte is the same as fp32's.

    python benchmarks/quantize_quality.py                   # demo-sized and a wider model, ~15 minutes on 2 cores
    python benchmarks/quantize_quality.py --sizes demo      # the demo-sized model only, ~2.5 minutes
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import lightspeed  # noqa: E402
from data import train_val_datasets  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

SIZES = {
    "demo": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),  # examples' "demo"
    "wide": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=6, n_embd=384),
}
FORMATS = ["fp16", "bf16", "fp6", "int8", "int4", "int4/g64"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="demo,wide", help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="comma-separated: fp16 / bf16 (weights rounded), fp6 / int8 / int4, fmt/gN for per-group")
    p.add_argument("--steps", type=int, default=1500, help="AdamW steps per model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--eval-windows", type=int, default=512, help="validation windows (of block_size bytes)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.sizes = [s for s in args.sizes.split(",") if s]
    for s in args.sizes:
        if s not in SIZES:
            p.error(f"--sizes: unknown size {s!r} (known: {', '.join(SIZES)})")
    args.formats = [f for f in args.formats.split(",") if f]
    for f in args.formats:
        try:
            _parse_format(f)
        except ValueError as e:
            p.error(f"--formats: {e}")
    if args.steps < 1 or args.batch < 1 or args.eval_windows < 1:
        p.error("--steps, --batch and --eval-windows must be at least 1")
    return args


def _parse_format(name: str) -> tuple[str, int | None]:
    fmt, _, group = name.partition("/g")
    if fmt not in ("fp16", "bf16", "fp6", "int8", "int4"):
        raise ValueError(f"unknown format {name!r}")
    if group and (not group.isdigit() or fmt in ("fp16", "bf16", "fp6")):
        raise ValueError(f"{name!r}: a group size /gN (N digits) goes with int8 or int4")
    return fmt, int(group) if group else None


def train(config: GPTConfig, steps: int, batch: int, seed: int) -> tuple[GPT, float]:
    """A GPT trained with AdamW (lr 1e-3, 50 warm-up steps, cosine to 1e-4) on the training nine tenths."""
    torch.manual_seed(seed)
    model = GPT(config)
    train_set, _ = train_val_datasets(config.block_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for step in range(steps):
        lr = 1e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(train_set), (batch,), generator=gen)
        x, y = (torch.stack(t) for t in zip(*(train_set[int(i)] for i in idx)))
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval(), time.perf_counter() - t0


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(validation loss in bits per byte, logits [windows, T, vocab] in fp32)."""
    logits = torch.cat([model(x[i:i + 64]).float() for i in range(0, x.shape[0], 64)])
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
    return loss.item() / math.log(2), logits


def variant(model: GPT, name: str) -> torch.nn.Module:
    """The trained model with its weights in format `name` (fp32 compute throughout)."""
    fmt, group = _parse_format(name)
    m = copy.deepcopy(model)
    if fmt in ("fp16", "bf16"):
        dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.data = mod.weight.data.to(dtype).float()
        return m
    quant = {"weight": fmt} if group is None else {"weight": fmt, "group_size": group}
    return lightspeed.init_inference(m, dtype=torch.float32, device="cpu", quant=quant)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads; {args.steps} AdamW steps per model")
    print(f"{'model':>6} {'params':>8} {'weights':>9} {'val bits/byte':>14} {'vs fp32':>8} {'logits rel err':>15} "
          f"{'top-1 same':>11}")
    for size in args.sizes:
        config = SIZES[size]
        model, secs = train(config, args.steps, args.batch, args.seed)
        _, val_set = train_val_datasets(config.block_size)
        n = min(args.eval_windows, len(val_set))
        x, y = (torch.stack(t) for t in zip(*(val_set[i] for i in range(n))))
        ref_bits, ref_logits = evaluate(model, x, y)
        params = sum(p.numel() for p in model.parameters())
        print(f"{size:>6} {params / 1e6:>7.2f}M {'fp32':>9} {ref_bits:>14.4f} {'':>8} {'':>15} {'':>11}"
              f"   (trained in {secs:.0f} s)", flush=True)
        for name in args.formats:
            bits, logits = evaluate(variant(model, name), x, y)
            err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
            same = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
            print(f"{size:>6} {'':>8} {name:>9} {bits:>14.4f} {bits - ref_bits:>+8.4f} {err:>15.4f} {same:>11.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
