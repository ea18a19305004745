"""Pipeline-parallel scripts through the `lightspeed` launcher on 2 CPU processes (gloo, pp=2):
examples/pipeline_gpt.py as its docstring launches it, and DeepSpeedExamples' unchanged
training/pipeline_parallelism/train.py (tests/fixtures/deepspeedexamples_pipeline: its data made
synthetic, README.md there) under `--as_deepspeed`. Each must exit 0 with its loss falling."""

import json
import math
import re

import pytest

from .conftest import REPO, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

EXAMPLE = REPO / "examples" / "pipeline_gpt.py"
DSX = REPO / "tests" / "fixtures" / "deepspeedexamples_pipeline"


def _fail(proc) -> str:
    return (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:]).strip()


def test_pipeline_gpt_example_trains(tmp_path, home):
    proc = run_cli(["--num_procs", 2, EXAMPLE, "--steps", 30, "--log-interval", 10], tmp_path, home,
                   timeout=240, LIGHTSPEED_ACCELERATOR="cpu")
    assert proc.returncode == 0, _fail(proc)
    assert "pp=2 (1f1b)" in proc.stdout and "stage bounds [0, 3, 7]" in proc.stdout, _fail(proc)
    losses = {int(s): float(v) for s, v in re.findall(r"step +(\d+)/30 +loss (\S+)", proc.stdout)}
    assert sorted(losses) == [1, 10, 20, 30], _fail(proc)
    assert losses[1] == pytest.approx(math.log(256), abs=0.3)  # a fresh byte-level model: about uniform
    assert losses[10] < losses[1] and losses[30] < losses[20] < losses[10] and losses[30] < 0.75 * losses[1]


@pytest.mark.no_real_deepspeed
def test_deepspeedexamples_pipeline_script_trains_as_deepspeed(tmp_path, home):
    # the vendored ds_config.json, its batch cut to 4 micro-batches of 8 and its loss printed every step
    config = json.loads((DSX / "ds_config.json").read_text())
    config.update(train_batch_size=32, steps_per_print=1)
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    proc = run_cli(["--as_deepspeed", "--num_procs", 2, DSX / "train.py", "--deepspeed_config",
                    tmp_path / "ds_config.json", "-p", 2, "--steps", 6, "--backend", "gloo"], tmp_path, home,
                   timeout=240, LIGHTSPEED_ACCELERATOR="cpu", SYNTHETIC_CIFAR_SIZE="64")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _fail(proc)
    assert "registered lightspeed as deepspeed" in out
    assert "micro batch 8 x 4 accumulation steps = 32 global" in out, _fail(proc)
    losses = [float(v) for v in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 6, _fail(proc)
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(10), abs=0.1)  # ten classes, untrained
    assert min(losses[3:]) < losses[0]
