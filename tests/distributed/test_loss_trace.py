"""A fixed-seed CPU loss trace at every ZeRO stage, kept bitwise identical across refactors.

The golden file `loss_trace.json` holds, per case, the losses of 6 optimizer steps (2 micro-steps each,
gradient clipping on) and the final parameters' sum, as float.hex strings: a change to the step
sequence, the saved layout or the reductions that alters any bit fails here. Regenerate only for an
intended change of numerics: `python tests/distributed/test_loss_trace.py --write`.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

GOLDEN = os.path.join(os.path.dirname(__file__), "loss_trace.json")
STEPS, MICRO, GAS = 6, 2, 2


def _cases():
    base = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 1000,
            "gradient_clipping": 0.5}
    adam = {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01}}
    cases = {}
    for stage in (0, 1, 2, 3):
        z = {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64,
             "stage3_param_persistence_threshold": 0}
        cases[f"s{stage}-fp32-fused"] = (dict(base, optimizer=adam, zero_optimization=z), None)
        cases[f"s{stage}-fp32-torch"] = (dict(base, zero_optimization=z), "sgd")
        cases[f"s{stage}-bf16"] = (dict(base, optimizer=adam, zero_optimization=z, bf16={"enabled": True}), None)
        cases[f"s{stage}-fp16"] = (dict(base, optimizer=adam, zero_optimization=z,
                                        fp16={"enabled": True, "initial_scale_power": 16, "hysteresis": 1}), None)
    return cases


def _run_case(config, opt):
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1234)
    model = TinyMLP(seed=3)
    optimizer = (lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)) if opt == "sgd" else None
    engine, *_ = lightspeed.initialize(model=model, config=config, optimizer=optimizer)
    x, y = regression_data(STEPS * GAS * MICRO * world)
    dtype = next(p.dtype for p in engine.module.parameters() if p.is_floating_point())
    losses = []
    for i in range(STEPS * GAS):
        base = (i * world + rank) * MICRO
        loss = engine(x[base:base + MICRO].to(dtype), y[base:base + MICRO])
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append((t / world).item().hex())
    state = engine.strategy.module_state_dict()
    total = sum(float(v.double().sum()) for k, v in sorted(state.items()) if v.is_floating_point())
    return {"losses": losses, "param_sum": total.hex(), "skipped": engine.skipped_steps}


def _worker():
    return {name: _run_case(cfg, opt) for name, (cfg, opt) in _cases().items()}


def test_loss_trace_is_unchanged():
    with open(GOLDEN) as f:
        golden = json.load(f)
    got = run_world(_worker, 2)[0]
    assert sorted(got) == sorted(golden)
    for name in golden:
        assert got[name] == golden[name], name


if __name__ == "__main__" and "--write" in sys.argv:
    with open(GOLDEN, "w") as f:
        json.dump(run_world(_worker, 2)[0], f, indent=1, sort_keys=True)
        f.write("\n")
