"""The `flops_profiler` block in training: a real `initialize()`d engine (world size 1, in process)
profiles step `profile_step` and writes or logs the profile with the engine's timers."""

from __future__ import annotations

import logging

import pytest
import torch

import lightspeed
from lightspeed.config.monitoring import FlopsProfilerConfig
from lightspeed.profiling.flops_profiler import FlopsProfiler, number_to_string
from lightspeed.profiling.step_profiler import StepProfiler
from lightspeed.testing.models import TinyMLP, regression_data

pytestmark = pytest.mark.timeout(120)

MICRO, GAS = 2, 2
# TinyMLP: Linear(13 -> 37) and Linear(37 -> 5) per micro-batch, every micro-batch of the step counted
STEP_FLOPS = GAS * (2 * MICRO * 13 * 37 + 2 * MICRO * 37 * 5)


def _engine(profiler: dict):
    cfg = {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "flops_profiler": profiler}
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=cfg, dist_init_required=False)
    return engine


def _step(engine, seed):
    x, y = regression_data(MICRO * GAS, seed=seed)
    for micro in range(GAS):
        loss = engine(x[micro * MICRO:(micro + 1) * MICRO], y[micro * MICRO:(micro + 1) * MICRO])
        engine.backward(loss)
        engine.step()


def test_profile_step_written_to_output_file(tmp_path):
    out = tmp_path / "profile.txt"
    engine = _engine({"enabled": True, "profile_step": 1, "output_file": str(out), "module_depth": 0,
                      "recompute_fwd_factor": 0.5})
    assert isinstance(engine.flops_profiler, FlopsProfiler)
    assert engine.timers.enabled  # the profiler turns the wall-clock breakdown on, as in DeepSpeed
    _step(engine, 1)
    assert engine.flops_profiler.started and not out.exists()  # step 1 (0-based) is being profiled
    _step(engine, 2)
    assert not engine.flops_profiler.started
    text = out.read_text()
    rows = {row.split(":")[0]: row.split(":", 1)[1].strip() for row in text.splitlines() if ":" in row}
    assert "Profile Summary at step 2:" in text
    assert rows["world size"] == "1" and rows["batch size per GPU"] == str(MICRO)
    assert rows["gradient accumulation steps"] == str(GAS)
    assert rows["fwd flops per GPU"] == number_to_string(STEP_FLOPS).strip()
    assert rows["fwd MACs per GPU (2 forward calls)"] == number_to_string(STEP_FLOPS // 2) + "MACs"
    for key in ("bwd latency", "step latency", "iter latency", "samples/second",
                "bwd FLOPS per GPU = 2.5 * fwd flops per GPU / bwd latency",
                "FLOPS per GPU = 3.5 * fwd flops per GPU / iter latency"):
        assert key in rows, key
    assert rows["MFU (FLOPS per GPU / peak)"] == "unknown"  # CPU
    assert "depth 0:" in text and "depth 1:" not in text
    assert any(row.startswith("  fc1 (Linear): ") for row in text.splitlines())
    _step(engine, 3)  # later steps are not profiled
    assert out.read_text() == text


def test_profile_step_0_logged(ls_caplog):
    ls_caplog.set_level(logging.INFO, logger="lightspeed")
    engine = _engine({"enabled": True, "profile_step": 0, "detailed": False})
    _step(engine, 1)
    logged = "\n".join(r.getMessage() for r in ls_caplog.records)
    assert "Profile Summary at step 1:" in logged and "Aggregated Profile per GPU" in logged
    assert "Detailed Profile" not in logged


def test_disabled_and_other_ranks_do_nothing():
    engine = _engine({"enabled": False})
    assert engine.flops_profiler is None and not engine.step_profiler.active and not engine.timers.enabled
    _step(engine, 1)
    other = StepProfiler(FlopsProfilerConfig(enabled=True, profile_step=0), torch.nn.Linear(2, 2), rank=1)
    assert not other.active and not other.profiler.started
    other.after_step(1, {})


def test_profile_started_before_a_checkpoint_load_ends_at_the_next_step(tmp_path):
    model = torch.nn.Linear(3, 2)
    out = tmp_path / "p.txt"
    prof = StepProfiler(FlopsProfilerConfig(enabled=True, profile_step=0, output_file=str(out)), model, rank=0)
    assert prof.profiler.started
    model(torch.randn(4, 3))
    prof.after_step(12, {})  # the engine resumed at step 11
    assert not prof.profiler.started and "Profile Summary at step 12:" in out.read_text()
    rows = {row.split(":")[0]: row.split(":", 1)[1].strip() for row in out.read_text().splitlines() if ":" in row}
    assert rows["fwd flops per GPU"] == "48"  # 2 * 4 * 3 * 2


def test_user_profiler_with_ds_engine_prints_the_run(ls_caplog):
    ls_caplog.set_level(logging.INFO, logger="lightspeed")
    engine = _engine({"enabled": False})
    prof = FlopsProfiler(engine.module, ds_engine=engine)
    prof.start_profile()
    _step(engine, 1)
    prof.print_model_profile(profile_step=1, detailed=False)
    prof.end_profile()
    logged = "\n".join(r.getMessage() for r in ls_caplog.records)
    rows = {row.split(":")[0]: row.split(":", 1)[1].strip() for row in logged.splitlines() if ":" in row}
    assert rows["world size"] == "1" and rows["samples per step"] == str(MICRO * GAS)
    assert rows["fwd flops per GPU"] == number_to_string(STEP_FLOPS).strip()
