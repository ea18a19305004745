"""Run by the DeepSpeed test environment's Python (see lightspeed/testing/deepspeed_env.py), not by pytest.

Usage: ``python deepspeed_moe_worker.py SPEC.json``. In one world of the spec's `world_size` processes
(gloo, DeepSpeed's CPU accelerator; a world per expert-parallel size), for each case: build the MoE model of
tests/fixtures/deepspeed_moe_checkpoint (`Linear -> tanh -> MoE(4 experts, top-2, nothing dropped) ->
Linear`, MSE) at the case's expert-parallel size, ``deepspeed.initialize`` it at the case's ZeRO stage
(DeepSpeed's MoE param groups, torch's AdamW, fp32 or bf16), ``load_checkpoint`` the case's directory and train its
steps on the fixtures' global batches (each rank its share). Rank r writes ``{"losses": [the global
batch's mean loss per step], "global_steps": N}`` (or ``{"error": traceback}``) to the spec's ``result``
path + ``.<case name>.<r>``. Imports nothing of lightspeed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # worker_exit, beside this file
from worker_exit import free_port, leave  # noqa: E402

D, SEQ, GLOBAL, EXPERTS, LR = 8, 4, 4, 4, 0.02


def _batch(step: int):
    import torch

    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL, SEQ, D, generator=gen), torch.randn(GLOBAL, SEQ, generator=gen)


def _case(case: dict, rank: int, world: int) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(D, D)
            self.moe = MoE(D, nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D)), num_experts=EXPERTS,
                           ep_size=case["ep"], k=2, drop_tokens=False, use_rts=False, min_capacity=0,
                           top2_2nd_expert_sampling=False)
            self.head = nn.Linear(D, 1)

        def forward(self, x, y):
            out, _, _ = self.moe(torch.tanh(self.inp(x.to(self.inp.weight.dtype))))
            return F.mse_loss(self.head(out).squeeze(-1).float(), y)

    torch.manual_seed(1)  # not the saved values: the load must replace every one
    net = Net()
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "dense"})
    micro = GLOBAL // world
    config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": case["stage"]}}
    if case["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=params, config=config)
    engine.load_checkpoint(case["checkpoint"])
    losses = []
    for step in case["steps"]:
        x, y = _batch(step)
        loss = engine(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {"losses": losses, "global_steps": engine.global_steps}


def _run(rank: int, spec: dict, ep: int, port: int) -> None:
    import deepspeed
    import torch

    world = spec["world_size"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    for case in spec["cases"]:
        if case["ep"] != ep:
            continue
        try:
            out = _case(case, rank, world)
        except Exception:
            out = {"error": traceback.format_exc()}
        with open(f"{spec['result']}.{case['name']}.{rank}", "w") as f:  # every rank's: any rank's error is seen
            json.dump(out, f)
    leave()  # every result is on disk


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    # a world per expert-parallel size: DeepSpeed's expert groups are process-wide
    for ep in dict.fromkeys(case["ep"] for case in spec["cases"]):
        port = free_port()
        mp.spawn(_run, args=(spec, ep, port), nprocs=spec["world_size"])
