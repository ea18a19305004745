"""The engine's monitor events, written by a real `initialize()`d engine (world size 1, in process) and
read back from TensorBoard's event files, the CSVs and a wandb offline run: DeepSpeed's names, values
and sample x-axis."""

from __future__ import annotations

import pytest
import torch

import lightspeed
from lightspeed.monitor import LOSS_SCALE, LR, TIMER_EVENTS, TRAIN_LOSS
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.monitor_files import read_csvs, read_tensorboard, read_wandb

pytestmark = pytest.mark.timeout(180)

MICRO, GAS, STEPS = 2, 3, 3
BATCH = MICRO * GAS


def _train(config: dict, dtype=torch.float32):
    """Run STEPS optimizer steps; returns the engine, each step's micro-batch losses and each step's
    learning rate after the step."""
    cfg = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                         "warmup_num_steps": 4, "warmup_type": "linear"}},
           **config}  # fmt: skip
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=cfg, dist_init_required=False)
    x, y = regression_data(BATCH * STEPS)
    losses, lrs = [], []
    for step in range(STEPS):
        step_losses = []
        for micro in range(GAS):
            lo = (step * GAS + micro) * MICRO
            loss = engine(x[lo:lo + MICRO].to(dtype), y[lo:lo + MICRO])
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(step_losses)
        lrs.append(engine.get_lr()[0])
    return engine, losses, lrs


def test_events_names_values_and_sample_axis(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    out = str(tmp_path)
    engine, losses, lrs = _train({
        "wall_clock_breakdown": True,
        "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"},
        "wandb": {"enabled": True, "project": "lightspeed-test"},
    })
    engine.monitor.close()
    import wandb

    wandb.teardown()

    # train_loss: the window's mean, at the samples seen before the step; the rest after it
    expected = {
        TRAIN_LOSS: [(BATCH * s, pytest.approx(sum(ls) / GAS, rel=1e-5)) for s, ls in enumerate(losses)],
        LR: [(BATCH * (s + 1), pytest.approx(lr, rel=1e-5)) for s, lr in enumerate(lrs)],
    }
    assert len(set(lrs)) == STEPS  # the warm-up moves it every step: the values say which step wrote them
    tb = read_tensorboard(f"{out}/tb")
    assert set(tb) == {TRAIN_LOSS, LR, *TIMER_EVENTS}  # no loss scale without fp16
    assert {k: tb[k] for k in expected} == expected
    for name in TIMER_EVENTS:
        assert [s for s, _ in tb[name]] == [BATCH * (s + 1) for s in range(STEPS)]
        assert all(v >= 0 for _, v in tb[name])
    assert all(v > 0 for name in ("forward", "backward", "step") for _, v in
               tb[f"Train/Samples/elapsed_time_ms_{name}"])
    # backward = backward_inner + backward_allreduce
    for (_, whole), (_, inner), (_, wait) in zip(*(tb[f"Train/Samples/elapsed_time_ms_{n}"] for n in
                                                   ("backward", "backward_inner", "backward_allreduce"))):
        assert whole == pytest.approx(inner + wait, rel=1e-4)

    csvs = read_csvs(f"{out}/csv")
    assert csvs["Train_Samples_train_loss"] == ("train_loss", expected[TRAIN_LOSS])
    assert csvs["Train_Samples_lr"] == ("lr", expected[LR])
    assert csvs["Train_Samples_elapsed_time_ms_forward"][0] == "elapsed_time_ms_forward"

    info, history = read_wandb(out)
    assert info["project"] == "lightspeed-test"
    assert {k: history[k] for k in expected} == expected


def test_fp16_adds_loss_scale_and_no_timers_without_breakdown(tmp_path):
    engine, _, _ = _train({"fp16": {"enabled": True, "initial_scale_power": 5},
                           "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}},
                          dtype=torch.float16)
    csvs = read_csvs(str(tmp_path / "j"))
    assert set(csvs) == {"Train_Samples_train_loss", "Train_Samples_lr", "Train_Samples_loss_scale"}
    assert csvs["Train_Samples_loss_scale"] == ("loss_scale", [(BATCH * (s + 1), 32.0) for s in range(STEPS)])
    assert engine.monitor.enabled and LOSS_SCALE == "Train/Samples/loss_scale"


def test_write_events_from_user_code(tmp_path):
    engine, _, _ = _train({"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}})
    engine.monitor.write_events([("Eval/Samples/eval_loss", 0.25, engine.global_samples)])
    assert read_csvs(str(tmp_path / "j"))["Eval_Samples_eval_loss"] == ("eval_loss", [(BATCH * STEPS, 0.25)])


def test_disabled_monitor_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine, _, _ = _train({})
    assert not engine.monitor.enabled
    assert list(tmp_path.iterdir()) == []


def test_missing_library_fails_initialize(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ImportError, match=r"^tensorboard.enabled needs the `tensorboard` package"):
        _train({"tensorboard": {"enabled": True}})
