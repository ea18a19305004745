"""The training script benchmarks/autotune.py tunes: examples/gpt.py's GPT on random tokens, built from
--deepspeed_config with lightspeed.initialize (or, with --deepspeed, real DeepSpeed's initialize, for its
autotuner). Under autotuning the engine ends the process after the profile window."""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.gpt import GPT, GPTConfig  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--deepspeed", action="store_true", help="train with real DeepSpeed")
parser.add_argument("--preset", default="gpt2")
parser.add_argument("--seq", type=int, default=1024)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--checkpoint_activations", action="store_true")
args = parser.parse_args()

if args.deepspeed:
    import deepspeed as engine_lib
else:
    import lightspeed as engine_lib

torch.manual_seed(0)
model = GPT(GPTConfig.preset(args.preset, block_size=args.seq))
if args.checkpoint_activations:
    for block in model.blocks:
        block.forward = (lambda f: lambda x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False))(block.forward)
engine, _, _, _ = engine_lib.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
micro = engine.train_micro_batch_size_per_gpu()
device = next(engine.module.parameters()).device
vocab = model.config.vocab_size
for _ in range(args.steps * engine.gradient_accumulation_steps()):
    idx = torch.randint(0, vocab, (micro, args.seq), device=device)
    loss = engine(idx, idx)
    engine.backward(loss)
    engine.step()
