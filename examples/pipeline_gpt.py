"""A small GPT trained with pipeline parallelism: the model written as a `PipelineModule`, Megatron-style.

    lightspeed --num_procs 2 examples/pipeline_gpt.py              # 2 CPU processes (gloo), pp=2, < 1 minute
    lightspeed --num_gpus 2 examples/pipeline_gpt.py --preset gpt2 --micro 8 --micro-batches 8
    lightspeed --num_procs 2 examples/pipeline_gpt.py --schedule zbv_zero_bubble

The layers, in pipeline order: the token + position embedding (a `TiedLayerSpec` keyed "embed"), the
transformer blocks (a `LayerSpec` each: examples/gpt.py's `Block`), the final LayerNorm, and the LM
head: the same "embed" module again, run through `forward_fn=lm_logits` (hidden states times the token
embedding transposed). The first and the last stage each hold a copy of the embedding; lightspeed
makes them equal at start-up and sums their weight gradients over the stages, as DeepSpeed does.

`engine.train_batch()` runs one optimizer step over `--micro-batches` micro-batches through the
schedule of the config's `pipeline.schedule` ("1f1b", DeepSpeed's, by default). The data is synthetic:
each sequence follows `next = (5 * token + 3) mod vocab` from a random start, which the model learns
within a few dozen steps, so the printed loss falls visibly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import lightspeed
from lightspeed.parallel.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt.py sits beside this script
from gpt import PRESETS, Block, GPTConfig  # noqa: E402


class Embedding(nn.Module):
    """Token + learned position embeddings: the first layer, and (through `lm_logits`) the LM head."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


def lm_logits(embedding: Embedding, hidden: torch.Tensor) -> torch.Tensor:
    """The tied LM head: hidden states times the token embedding transposed."""
    return hidden @ embedding.wte.weight.t()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt_pipeline(config: GPTConfig, num_stages: int, partition_method: str = "type:Block") -> PipelineModule:
    """The GPT as a PipelineModule of `num_stages` stages; the blocks are spread evenly ("type:Block")."""
    layers = [
        TiedLayerSpec("embed", Embedding, config, tied_weight_attr=["wte.weight"]),
        *[LayerSpec(Block, config) for _ in range(config.n_layer)],
        LayerSpec(nn.LayerNorm, config.n_embd),
        TiedLayerSpec("embed", Embedding, config, forward_fn=lm_logits, tied_weight_attr=["wte.weight"]),
    ]
    return PipelineModule(layers, num_stages=num_stages, loss_fn=lm_loss, partition_method=partition_method)


def batches(config: GPTConfig, micro: int, seed: int):
    """Endless (inputs, labels) micro-batches of the synthetic sequences."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.arange(config.block_size + 1)
    while True:
        start = torch.randint(0, config.vocab_size, (micro, 1), generator=g)
        tokens = start.clone()
        seq = [tokens]
        for _ in steps[1:]:
            tokens = (5 * tokens + 3) % config.vocab_size
            seq.append(tokens)
        seq = torch.cat(seq, dim=1)
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (the world size must be a multiple)")
    p.add_argument("--schedule", default="1f1b", help="pipeline.schedule: 1f1b, gpipe, interleaved_1f1b, "
                                                      "interleaved_zero_bubble or zbv_zero_bubble")
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS), help="model size (examples/gpt.py)")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: the preset's)")
    p.add_argument("--micro", type=int, default=8, help="micro-batch size")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (accumulation)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=None, help="accepted for DeepSpeed-launcher compatibility")
    return p.parse_args(argv)


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    overrides = {"n_layer": args.layers} if args.layers else {}
    config = GPTConfig.preset(args.preset, **overrides)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "pipeline": {"schedule": args.schedule},
        "steps_per_print": 10**9,
    }
    if torch.cuda.is_available():
        ds_config["bf16"] = {"enabled": True}
    lightspeed.init_distributed()  # before the PipelineModule: it places its stages on the world's ranks
    torch.manual_seed(args.seed)
    net = gpt_pipeline(config, args.pp)
    engine, *_ = lightspeed.initialize(model=net, config=ds_config,
                                       model_parameters=[p for p in net.parameters() if p.requires_grad])
    rank = int(os.environ.get("RANK", 0))
    data = batches(config, args.micro, args.seed + engine.groups.dp_rank)
    if rank == 0:
        print(f"GPT {config.n_layer} blocks x {config.n_embd} wide, pp={args.pp} ({args.schedule}), "
              f"{args.micro_batches} micro-batches of {args.micro} x {config.block_size} tokens per step; "
              f"stage bounds {net.parts}", flush=True)
    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        losses.append(float(engine.train_batch(data)))
        if rank == 0 and (step % args.log_interval == 0 or step == 1):
            print(f"step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  {time.perf_counter() - start:.1f}s", flush=True)
    return losses


if __name__ == "__main__":
    main()
