"""An unchanged DeepSpeed training script (no lightspeed import): argparse with
deepspeed.add_config_arguments, deepspeed.comm, get_accelerator, deepspeed.zero.Init and
deepspeed.initialize, a few steps. Rank 0 writes the global mean loss of each step to --out."""

import argparse
import json

import torch

import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--out", required=True)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device(get_accelerator().device_name(get_accelerator().current_device()))
torch.manual_seed(1234)

with open(args.deepspeed_config) as f:
    ds_config = json.load(f)
with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=ds_config["zero_optimization"]["stage"] == 3):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())

micro = engine.train_micro_batch_size_per_gpu()
x = torch.randn(micro * world, 8, generator=torch.Generator().manual_seed(7))  # one global batch, seen every step
y = x.sum(dim=1, keepdim=True).sin()
losses = []
for step in range(args.steps):
    xb, yb = x[rank * micro:(rank + 1) * micro].to(device), y[rank * micro:(rank + 1) * micro].to(device)
    loss = torch.nn.functional.mse_loss(engine(xb), yb)
    engine.backward(loss)
    engine.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    losses.append(mean.item() / world)
if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "version": deepspeed.__version__, "overflow": optimizer.overflow,
                   "engine": type(engine).__name__, "accelerator": get_accelerator().device_name()}, f)
