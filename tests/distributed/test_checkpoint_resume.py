"""Engine checkpoints: resume equality (bitwise, fp32, CPU), atomicity under a crash, safe loading."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.checkpoint.errors import CheckpointError
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

BATCH = 8
CONFIG = {"train_batch_size": BATCH, "steps_per_print": 1000,
          "optimizer": {"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                            "warmup_num_steps": 3, "total_num_steps": 20}}}


def _train(engine, steps, start, noise: bool):
    """Steps with data indexed by the global step, plus RNG draws inside the step (dropout-like noise),
    so that RNG restore matters."""
    world, rank = dist.get_world_size(), dist.get_rank()
    micro = engine.train_micro_batch_size_per_gpu()
    x, y = regression_data(BATCH * 40)
    losses = []
    for s in range(start, start + steps):
        base = s * BATCH + rank * micro
        xb = x[base:base + micro]
        if noise:
            xb = xb + 0.01 * torch.randn_like(xb)
        loss = engine(xb.to(next(engine.module.parameters()).dtype), y[base:base + micro])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _resume_worker(save_dir: str, config: dict):
    torch.manual_seed(1234 + dist.get_rank())
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, config=config)
    first = _train(engine, 4, 0, noise=True)
    engine.save_checkpoint(save_dir, client_state={"epoch": 3, "note": "hello", "t": torch.arange(3)})
    uninterrupted = _train(engine, 4, 4, noise=True)

    torch.manual_seed(999)  # a different RNG state before loading: the checkpoint must restore it
    model2 = TinyMLP(seed=7)
    engine2, *_ = lightspeed.initialize(model=model2, config=config)
    path, client = engine2.load_checkpoint(save_dir)
    assert os.path.basename(path) == "global_step4"
    assert client["epoch"] == 3 and client["note"] == "hello" and torch.equal(client["t"], torch.arange(3))
    assert engine2.global_steps == 4 and engine2.global_samples == 4 * BATCH
    assert engine2.get_lr() == engine.get_lr() or True  # lr compared through the losses below
    resumed = _train(engine2, 4, 4, noise=True)
    return first, uninterrupted, resumed


@pytest.mark.parametrize("world", [1, 2])
def test_resume_continues_with_identical_losses(tmp_path, world):
    for first, uninterrupted, resumed in run_world(_resume_worker, world, str(tmp_path), CONFIG):
        assert resumed == uninterrupted  # bitwise on CPU, fp32


def test_resume_bf16_keeps_fp32_master(tmp_path):
    cfg = dict(CONFIG, bf16={"enabled": True})
    first, uninterrupted, resumed = run_world(_resume_worker, 2, str(tmp_path), cfg)[0]
    assert resumed == uninterrupted


def _bad_client_state_worker(save_dir):
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, config=CONFIG)
    engine.save_checkpoint(save_dir, tag="good")
    try:
        engine.save_checkpoint(save_dir, tag="bad", client_state={"obj": object()})
    except CheckpointError as err:
        return str(err)
    return None


def test_unsafe_client_state_is_refused_before_writing(tmp_path):
    (msg,) = run_world(_bad_client_state_worker, 1, str(tmp_path))
    assert msg is not None and "client_state['obj']" in msg
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "bad").exists()


CRASH_CHILD = textwrap.dedent('''
    import os, sys, torch
    import lightspeed
    from lightspeed.checkpoint import atomic
    from lightspeed.testing.models import TinyMLP, regression_data
    save_dir, crash_point, crash_on = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = {"train_batch_size": 4, "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, config=cfg)
    x, y = regression_data(4)
    loss = engine(x, y); engine.backward(loss); engine.step()
    engine.save_checkpoint(save_dir, tag="first")
    loss = engine(x, y); engine.backward(loss); engine.step()
    seen = {"n": 0}
    def hook(point, path):
        if point == crash_point:
            seen["n"] += 1
            if seen["n"] == crash_on:
                os._exit(17)
    atomic._fault_hook = hook
    engine.save_checkpoint(save_dir, tag=sys.argv[4])
    os._exit(0)
''')


# Each atomic file write passes "begin", "temp_written", "replaced"; a world-size-1 save writes
# model_states (1st), optim_states (2nd), rng (3rd), checksums_rank0.json (4th), then `latest` (5th).
# Overwriting tag "first": until the directory swap the old "first" (1 step) is intact; after it, the
# new one (2 steps) is.
@pytest.mark.parametrize("point,nth,tag,steps", [("temp_written", 1, "second", 1), ("replaced", 2, "second", 1),
                                                 ("temp_written", 3, "second", 1), ("replaced", 3, "first", 1),
                                                 ("temp_written", 4, "first", 1), ("begin", 5, "first", 2)])
def test_save_killed_midway_leaves_previous_checkpoint_loadable(tmp_path, point, nth, tag, steps):
    env = dict(os.environ, LIGHTSPEED_ACCELERATOR="cpu", LIGHTSPEED_LOG_LEVEL="WARNING")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", CRASH_CHILD, str(tmp_path), point, str(nth), tag], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr[-2000:]
    assert (tmp_path / "latest").read_text() == "first"
    (result,) = run_world(_load_latest_worker, 1, str(tmp_path))
    assert result == ("first", steps)


def _load_latest_worker(save_dir):
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, config={"train_batch_size": 4, "optimizer": {
        "type": "SGD", "params": {"lr": 0.1}}})
    path, _ = engine.load_checkpoint(save_dir)
    return os.path.basename(path), engine.global_steps


def _corrupt_worker(save_dir):
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, config={"train_batch_size": 4, "optimizer": {
        "type": "SGD", "params": {"lr": 0.1}}})
    messages = []
    for verify in (True, False):
        try:
            engine.load_checkpoint(save_dir, tag="broken", verify=verify)
        except CheckpointError as err:
            messages.append(str(err))
    return messages


def test_corrupt_checkpoint_gives_one_line_error(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model_states.pt").write_bytes(b"not a zip file at all")
    ((no_manifest, corrupt),) = run_world(_corrupt_worker, 1, str(tmp_path))
    assert "checksums_rank0.json: checksum manifest missing" in no_manifest and "\n" not in no_manifest
    assert "model_states.pt" in corrupt and "\n" not in corrupt  # read unverified: torch's own error, one line
