"""`lightspeed demo` end to end: two CPU processes through the elastic agent, a few steps, a checkpoint."""

import os
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.dist


def _run(args, tmp_path, timeout=240):
    # PYTHONPATH: this checkout, whatever an editable install of lightspeed points at.
    env = dict(os.environ, LIGHTSPEED_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "lightspeed.launcher.cli", *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)


def test_demo_trains_and_saves_a_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    proc = _run(["demo", "--nproc", "2", "--steps", "40", "--log_interval", "20", "--eval_batches", "2",
                 "--gen_bytes", "16", "--save_dir", str(save)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step    40/40" in proc.stdout and "val loss" in proc.stdout
    assert (save / "latest").read_text() == "global_step40"
    assert (save / "global_step40" / "model_states.pt").is_file()


def test_demo_rejects_bad_arguments_before_starting(tmp_path):
    proc = _run(["demo", "--nproc", "0"], tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "--nproc must be at least 1" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
