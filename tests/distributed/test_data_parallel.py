"""Data parallelism (ZeRO stage 0) on real gloo processes against a single-process reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

GLOBAL_BATCH = 24
STEPS = 8
OPT = {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01}}


def reference_losses(steps: int, clip: float = 0.0, global_batch: int = GLOBAL_BATCH):
    """Plain PyTorch: the whole global batch in one process."""
    torch.manual_seed(0)
    model = TinyMLP()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    x, y = regression_data(global_batch * steps)
    losses = []
    for s in range(steps):
        xb, yb = x[s * global_batch:(s + 1) * global_batch], y[s * global_batch:(s + 1) * global_batch]
        loss = model(xb, yb)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def engine_losses(steps: int, config: dict, global_batch: int = GLOBAL_BATCH):
    """Each rank takes its slice of each micro-batch of the global batch; returns the global mean
    loss of every step and the final parameters."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = TinyMLP()
    engine, _, _, _ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gas = engine.gradient_accumulation_steps()
    micro = engine.train_micro_batch_size_per_gpu()
    assert micro * gas * world == global_batch
    x, y = regression_data(global_batch * steps)
    x = x.to(next(engine.module.parameters()).dtype)  # the model runs in its training dtype
    losses = []
    for s in range(steps):
        step_loss = torch.zeros(())
        for m in range(gas):
            base = s * global_batch + m * micro * world + rank * micro
            loss = engine(x[base:base + micro], y[base:base + micro])
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach() / gas
        dist.all_reduce(step_loss)
        losses.append((step_loss / world).item())
    state = {k: v.float().clone() for k, v in engine.module.state_dict().items()}
    return losses, state, engine.get_global_grad_norm()


def _config(world: int, gas: int = 1, **extra):
    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas, "optimizer": copy.deepcopy(OPT),
           "steps_per_print": 1000, "gradient_clipping": 0.0}  # the references do not clip (DeepSpeed's default does)
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize("world", [1, 2, 4])
def test_data_parallel_matches_single_process(world):
    ref, ref_state = reference_losses(STEPS)
    results = run_world(engine_losses, world, STEPS, _config(world))
    for losses, state, _ in results:
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-7)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world,gas", [(1, 4), (2, 3)])
def test_gradient_accumulation_equals_large_batch(world, gas):
    ref, ref_state = reference_losses(STEPS)
    (losses, state, _), *_ = run_world(engine_losses, world, STEPS, _config(world, gas))
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-7)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_gradient_clipping_matches_clip_grad_norm():
    ref, ref_state = reference_losses(STEPS, clip=0.05)
    (losses, state, norm), _ = run_world(engine_losses, 2, STEPS, _config(2, gradient_clipping=0.05))
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-7)
    assert norm is not None and norm > 0.05  # the clip was active
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


REDUCTION_OPTIONS = ({"prescale_gradients": True}, {"gradient_predivide_factor": 2.0},
                     {"communication_data_type": "fp32"})


def _reduction_options():
    return [engine_losses(STEPS, _config(4, **extra))[0] for extra in REDUCTION_OPTIONS]


def test_reduction_options_keep_the_average():
    ref, _ = reference_losses(STEPS)
    for extra, losses in zip(REDUCTION_OPTIONS, run_world(_reduction_options, 4)[0]):  # one world for all
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-7), extra


def test_bf16_training_tracks_fp32():
    ref, _ = reference_losses(STEPS)
    (losses, state, _), _ = run_world(engine_losses, 2, STEPS, _config(2, bf16={"enabled": True}))
    assert losses == pytest.approx(ref, rel=3e-2, abs=1e-2)
    assert losses[-1] < losses[0]


def _fp16_overflow_run(inject_at: set[int], stage: int = 0):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = TinyMLP()
    cfg = _config(world, zero_optimization={"stage": stage}, fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2,
                               "hysteresis": 1, "min_loss_scale": 1},
                  scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                            "warmup_num_steps": 100, "warmup_type": "linear"}})
    engine, _, _, sched = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    micro = engine.train_micro_batch_size_per_gpu()
    x, y = regression_data(GLOBAL_BATCH * 8)
    trace = []
    for s in range(8):
        before = {k: v.clone() for k, v in engine.module.state_dict().items()}
        base = s * GLOBAL_BATCH + rank * micro
        loss = engine(x[base:base + micro].half(), y[base:base + micro])
        if s in inject_at and rank == world - 1:  # only the last rank overflows: every rank must skip
            loss = loss * float("inf")
        engine.backward(loss)
        scale_used = engine.loss_scale
        engine.step()
        changed = any(not torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
        trace.append((scale_used, engine.loss_scale, changed, engine.skipped_steps, engine.get_lr()[0],
                      engine.global_steps))
    return trace


def test_fp16_overflow_skips_step_on_every_rank_and_scale_recovers():
    traces = run_world(_fp16_overflow_run, 2, {2, 3})
    assert traces[0] == traces[1]
    trace = traces[0]
    scales = [t[1] for t in trace]
    changed = [t[2] for t in trace]
    skipped = [t[3] for t in trace]
    assert changed == [True, True, False, False, True, True, True, True]
    assert skipped == [0, 0, 1, 2, 2, 2, 2, 2]
    # hysteresis 1: each overflow halves the scale; window 2: it doubles once 2 clean steps have
    # passed since the last overflow (DeepSpeed's stable-interval rule)
    assert scales == [256, 256, 128, 64, 64, 64, 128, 128]
    # the LR schedule does not advance on skipped steps; global_steps does
    lrs = [t[4] for t in trace]
    assert lrs[2] == lrs[1] and lrs[3] == lrs[1] and lrs[4] > lrs[3]
    assert [t[5] for t in trace] == list(range(1, 9))


def _bf16_nan_run(check: bool):
    world, rank = dist.get_world_size(), dist.get_rank()
    model = TinyMLP()
    cfg = _config(world, bf16={"enabled": True, "check_grad_overflow": check})
    engine, *_ = lightspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    micro = engine.train_micro_batch_size_per_gpu()
    x, y = regression_data(GLOBAL_BATCH)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    loss = engine(x[rank * micro:(rank + 1) * micro].bfloat16(), y[rank * micro:(rank + 1) * micro])
    engine.backward(loss * float("nan") if rank == 0 else loss)
    engine.step()
    finite = all(torch.isfinite(v.float()).all() for v in engine.module.state_dict().values())
    unchanged = all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    return engine.skipped_steps, finite, unchanged


def _bf16_nan_runs():
    return _bf16_nan_run(True), _bf16_nan_run(False)


def test_bf16_check_grad_overflow_skips_nan_steps():
    assert run_world(_bf16_nan_runs, 2) == [((1, True, True), (0, False, False))] * 2
