"""The speculative offloaded step (`offload_optimizer.super_offload`, offload/speculative.py) against the
synchronous offloaded step on real gloo processes: bitwise equal when nothing rolls back, equal within
fp32 tolerance when clipping or an fp16 overflow makes it roll back.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world
from tests.distributed.test_data_parallel import GLOBAL_BATCH, _config

pytestmark = pytest.mark.dist

STEPS = 5
SMALL = {"reduce_bucket_size": 50, "allgather_bucket_size": 50, "stage3_param_persistence_threshold": 0}


def _zero(stage: int, speculative: bool) -> dict:
    z = {"stage": stage, **{k: v for k, v in SMALL.items() if stage == 3 or not k.startswith("stage3")}}
    z["offload_optimizer"] = {"device": "cpu", "super_offload": speculative}
    return z


def _run(cfg: dict, inject: set[int]):
    """(losses, module state, rollbacks, ranges stepped during backward); the last rank's loss is made
    inf at the steps in `inject`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    micro = engine.train_micro_batch_size_per_gpu()
    fp16 = engine.policy.param_dtype == torch.float16
    x, y = regression_data(GLOBAL_BATCH * STEPS)
    losses = []
    for s in range(STEPS):
        base = s * GLOBAL_BATCH + rank * micro
        dtype = engine.policy.param_dtype
        loss = engine(x[base:base + micro].to(dtype), y[base:base + micro].to(dtype if fp16 else torch.float32))
        if s in inject and rank == world - 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float().item())
    state = {k: v.float().cpu().clone() for k, v in engine.strategy.module_state_dict().items()}
    runner = engine.strategy._runner
    return losses, state, runner.rollbacks, runner.early_ranges, engine.skipped_steps


def _cases(world: int):
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}}
    cases = {}
    for spec in (False, True):
        tag = "spec" if spec else "sync"
        cases[f"plain-{tag}"] = (_config(world, zero_optimization=_zero(2, spec)), set())
        cases[f"inactive-{tag}"] = (_config(world, gradient_clipping=1e6, zero_optimization=_zero(2, spec)), set())
        cases[f"clip-{tag}"] = (_config(world, gradient_clipping=0.05, zero_optimization=_zero(2, spec)), set())
        cases[f"stage3-clip-{tag}"] = (_config(world, gradient_clipping=0.05, zero_optimization=_zero(3, spec)),
                                       set())
        cases[f"bf16-clip-{tag}"] = (_config(world, gradient_clipping=0.05, bf16={"enabled": True},
                                             zero_optimization=_zero(2, spec)), set())
        cases[f"fp16-{tag}"] = (_config(world, zero_optimization=_zero(1, spec), **copy.deepcopy(fp16)), {2})
    return cases


def _worker(world: int):
    return {name: _run(cfg, inject) for name, (cfg, inject) in _cases(world).items()}


@pytest.mark.parametrize("world", [1, 2])
def test_speculative_step_equals_the_synchronous_step(world):
    out = run_world(_worker, world, world)[0]
    for name in ("plain", "inactive", "fp16", "clip", "stage3-clip", "bf16-clip"):
        sync, spec = out[f"{name}-sync"], out[f"{name}-spec"]
        assert spec[3] > 0, name  # ranges were stepped during backward, from the first step on
        rollback = name in ("fp16", "clip", "stage3-clip", "bf16-clip")
        if rollback:
            assert spec[2] == (1 if name == "fp16" else STEPS), name
            assert spec[0] == pytest.approx(sync[0], rel=1e-6, abs=1e-7), name
            for k, v in sync[1].items():
                torch.testing.assert_close(spec[1][k], v, rtol=1e-6, atol=1e-7)
        else:
            assert spec[2] == 0, name
            assert spec[0] == sync[0], name
            for k, v in sync[1].items():
                assert torch.equal(spec[1][k], v), (name, k)
    assert out["fp16-spec"][4] == out["fp16-sync"][4] == 1  # the overflowed step was skipped
