"""Checkpoints load at another data-parallel world size and ZeRO stage, and a failed load changes nothing.

A run saves after 4 steps and continues for 4 more (the uninterrupted losses); a fresh run at another
(world size, stage) loads the checkpoint and trains the same 4 steps on the same global batches. The
global batch is the same at every world size, so the continued losses equal the uninterrupted ones up
to the order of floating-point sums: fp32 within 1e-5 relative, bf16 within its rounding.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

BATCH = 8


def _config(stage: int, bf16: bool = False, optimizer: str = "AdamW") -> dict:
    cfg = {"train_batch_size": BATCH, "steps_per_print": 1000, "gradient_clipping": 1.0,
           "optimizer": {"type": optimizer, "params": {"lr": 0.01, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                        "warmup_num_steps": 5}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50,
                                 "stage3_param_persistence_threshold": 0}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(engine, start: int, steps: int) -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    micro = BATCH // world
    x, y = regression_data(BATCH * 16)
    dtype = next(p.dtype for p in engine.module.parameters() if p.is_floating_point())
    losses = []
    for s in range(start, start + steps):
        base = s * BATCH + rank * micro
        loss = engine(x[base:base + micro].to(dtype), y[base:base + micro])
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _save_worker(save_dir: str, config: dict):
    torch.manual_seed(0)
    engine, *_ = lightspeed.initialize(model=TinyMLP(seed=5), config=config)
    _train(engine, 0, 4)
    engine.save_checkpoint(save_dir)
    return _train(engine, 4, 4)


def _load_worker(save_dir: str, config: dict):
    torch.manual_seed(0)
    engine, *_ = lightspeed.initialize(model=TinyMLP(seed=11), config=config)
    path, _ = engine.load_checkpoint(save_dir)
    assert os.path.basename(path) == "global_step4" and engine.global_steps == 4
    return _train(engine, 4, 4)


def _close(got, want, rel):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= rel * abs(b), (got, want)


@pytest.mark.parametrize("save, loads", [
    ((4, 3), [(2, 1), (1, 0)]),
    ((2, 2), [(4, 3)]),
    ((1, 0), [(4, 3), (2, 2)]),
])
def test_fp32_resume_at_other_world_size_and_stage(tmp_path, save, loads):
    world, stage = save
    uninterrupted = run_world(_save_worker, world, str(tmp_path), _config(stage))[0]
    for w, s in loads:
        resumed = run_world(_load_worker, w, str(tmp_path), _config(s))[0]
        _close(resumed, uninterrupted, 1e-5)


def test_bf16_resume_at_other_world_size_and_stage(tmp_path):
    uninterrupted = run_world(_save_worker, 2, str(tmp_path), _config(2, bf16=True))[0]
    resumed = run_world(_load_worker, 4, str(tmp_path), _config(3, bf16=True))[0]
    _close(resumed, uninterrupted, 2e-2)  # bf16 forward at other micro-batch splits: a few bf16 ulps


def _snapshot(engine):
    module = {k: v.clone() for k, v in engine.strategy.module_state_dict().items()}
    masters = [f.master_view().clone() for f in engine.strategy.fragments()]
    opt = engine.optimizer.state_dict()
    opt_state = {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                 for i, st in opt["state"].items()}
    return module, masters, opt_state, engine.global_steps, engine.lr_scheduler.state_dict()


def _same(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _failed_load_worker(save_dir: str, stage: int, damage: str):
    torch.manual_seed(0)
    engine, *_ = lightspeed.initialize(model=TinyMLP(seed=5), config=_config(stage))
    _train(engine, 0, 2)
    engine.save_checkpoint(save_dir)
    _train(engine, 2, 2)
    dist.barrier()
    tag_dir = os.path.join(save_dir, "global_step2")
    if dist.get_rank() == 0:
        if damage == "missing_rank_file":
            names = sorted(n for n in os.listdir(tag_dir) if n.startswith("optim_states"))
            os.remove(os.path.join(tag_dir, names[-1]))
        elif damage == "truncated":
            path = os.path.join(tag_dir, sorted(n for n in os.listdir(tag_dir) if n.startswith("optim_states"))[0])
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
    dist.barrier()
    if damage == "other_model":
        config = _config(stage)
        other, *_ = lightspeed.initialize(model=TinyMLP(d_hidden=41, seed=5), config=config)
        before = _snapshot(other)
        with pytest.raises(CheckpointError, match="shape"):
            other.load_checkpoint(save_dir)
        assert _same(before, _snapshot(other))
        return True
    before = _snapshot(engine)
    with pytest.raises(CheckpointError):
        engine.load_checkpoint(save_dir)
    assert _same(before, _snapshot(engine))
    return True


@pytest.mark.parametrize("stage, damage", [(0, "truncated"), (2, "missing_rank_file"), (3, "truncated"),
                                           (1, "other_model"), (3, "other_model")])
def test_failed_load_leaves_engine_unchanged(tmp_path, stage, damage):
    assert all(run_world(_failed_load_worker, 2, str(tmp_path), stage, damage))


def _gathered_worker(save_dir: str, config: dict):
    torch.manual_seed(0)
    engine, *_ = lightspeed.initialize(model=TinyMLP(seed=5), config=config)
    _train(engine, 0, 3)
    engine.save_checkpoint(save_dir)
    return {k: v.clone() for k, v in engine.strategy.module_state_dict().items()}


@pytest.mark.parametrize("world, stage", [(2, 3), (4, 2), (1, 0)])
def test_zero_to_fp32_equals_the_gathered_model(tmp_path, world, stage):
    from lightspeed.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    gathered = run_world(_gathered_worker, world, str(tmp_path), _config(stage))[0]
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert set(consolidated) == set(gathered)
    for name, value in gathered.items():
        assert torch.equal(consolidated[name], value), name
    without_frozen = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), exclude_frozen_parameters=True)
    assert set(without_frozen) == set(gathered) - {"frozen"}
