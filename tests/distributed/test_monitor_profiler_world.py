"""Monitors and the flops profiler on real gloo ranks (world size 2, ZeRO stage 3): only global rank 0
builds backends, writes events and profiles; the CSV rows and the profile come out once, and the
profile counts the full (gathered) parameters and every micro-batch's forward."""

from __future__ import annotations

import os

import pytest

import lightspeed
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.monitor_files import read_csvs, read_tensorboard
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

WORLD, MICRO, GAS, STEPS = 2, 2, 2, 3
BATCH = WORLD * MICRO * GAS


def _train(out_dir: str):
    import torch.distributed as dist

    cfg = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "zero_optimization": {"stage": 3},
           "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "csv"},
           "tensorboard": {"enabled": True, "output_path": out_dir, "job_name": "tb"},
           "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": os.path.join(out_dir, "profile.txt")}}
    model = TinyMLP()
    numel = sum(p.numel() for p in model.parameters())
    engine, *_ = lightspeed.initialize(model=model, config=cfg)
    rank = dist.get_rank()
    x, y = regression_data(BATCH * STEPS, seed=5)
    losses = []
    for step in range(STEPS):
        for micro in range(GAS):
            lo = ((step * GAS + micro) * WORLD + rank) * MICRO
            loss = engine(x[lo:lo + MICRO], y[lo:lo + MICRO])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    active = {"monitor_active": engine.monitor.active, "profiler_active": engine.step_profiler.active}
    engine.monitor.close()
    return {**active, "losses": losses, "numel": numel}


def test_rank_0_writes_events_and_profile_once(tmp_path):
    results = run_world(_train, WORLD, str(tmp_path))
    assert [r["monitor_active"] for r in results] == [True, False]
    assert [r["profiler_active"] for r in results] == [True, False]
    rank0 = results[0]["losses"]
    expected = [(BATCH * s, pytest.approx(sum(rank0[s * GAS:(s + 1) * GAS]) / GAS, rel=1e-5)) for s in range(STEPS)]
    header, rows = read_csvs(str(tmp_path / "csv"))["Train_Samples_train_loss"]
    assert rows == expected  # rank 0's own loss, one row per step
    assert read_tensorboard(str(tmp_path / "tb"))["Train/Samples/train_loss"] == expected
    assert len(os.listdir(tmp_path / "tb")) == 1  # one event file
    text = (tmp_path / "profile.txt").read_text()
    rows = {row.split(":")[0]: row.split(":", 1)[1].strip() for row in text.splitlines() if ":" in row}
    assert rows["world size"] == "2" and rows["data parallel size"] == "2"
    assert rows["params per GPU"] == str(results[0]["numel"])  # gathered sizes, not the shards
    assert rows["fwd flops per GPU"] == f"{round(GAS * (2 * MICRO * 13 * 37 + 2 * MICRO * 37 * 5) / 1e3, 2):g} K"
