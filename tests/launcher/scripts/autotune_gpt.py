"""A tiny GPT trained with lightspeed.initialize from --deepspeed_config, for the autotuning tests: the
engine ends the process after the profile window when the config's autotuning is enabled; otherwise it
trains --steps steps and rank 0 writes the config it ran with and its losses to --out."""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from examples.gpt import GPT, GPTConfig  # noqa: E402

import lightspeed  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--out", default=None)
parser.add_argument("--checkpoint_activations", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
if args.checkpoint_activations:
    for block in model.blocks:
        block.forward = (lambda f: lambda x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False))(block.forward)
engine, _, _, _ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
micro = engine.train_micro_batch_size_per_gpu()
gen = torch.Generator().manual_seed(engine.global_rank)
losses = []
for step in range(args.steps * engine.gradient_accumulation_steps()):
    idx = torch.randint(0, 64, (micro, 16), generator=gen)
    loss = engine(idx, idx)
    engine.backward(loss)
    engine.step()
    losses.append(float(loss))
if args.out and engine.global_rank == 0:
    Path(args.out).write_text(json.dumps({"losses": losses, "micro": micro,
                                          "stage": engine.zero_optimization_stage(),
                                          "gas": engine.gradient_accumulation_steps(),
                                          "ckpt": args.checkpoint_activations}))
