"""Pipeline-parallel scripts through the `lightspeed` launcher on 2 CPU processes (gloo, pp=2):
examples/pipeline_gpt.py as its docstring launches it, and DeepSpeedExamples' unchanged
training/pipeline_parallelism/train.py (tests/fixtures/deepspeedexamples_pipeline: its data made
synthetic, README.md there) under `--as_deepspeed`. Each must exit 0; the example's loss falls, the
DeepSpeed script's follows real DeepSpeed's."""

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
    """Real DeepSpeed's losses on the same files (expected_deepspeed.json): the same first two steps
    (same weights, data order and dropout masks); after two Adam steps the optimizers' rounding differs.
    Neither run's loss falls within 8 steps (AlexNet from scratch, Adam at 1e-3): "trains" here is
    DeepSpeed's own trajectory, every step's loss finite and changing."""
    expected = json.loads((DSX / "expected_deepspeed.json").read_text())
    config = json.loads((DSX / "ds_config.json").read_text())
    config.update(expected["config_changes"])  # 4 micro-batches of 8, the loss logged every step
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    proc = run_cli(["--as_deepspeed", "--num_procs", 2, DSX / "train.py", "--deepspeed_config",
                    tmp_path / "ds_config.json", "-p", 2, "--steps", 4, "--backend", "gloo"], tmp_path, home,
                   timeout=240, LIGHTSPEED_ACCELERATOR="cpu", SYNTHETIC_CIFAR_SIZE="64")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _fail(proc)
    assert "registered lightspeed as deepspeed" in out
    assert "micro batch 8 x 4 accumulation steps = 32 global" in out, _fail(proc)
    losses = [float(v) for v in re.findall(r"step \d+: loss (\S+)", out)]
    assert len(losses) == 4, _fail(proc)
    assert losses[:2] == pytest.approx(expected["losses"][:2], abs=5e-4)
    assert all(math.isfinite(x) and abs(x - math.log(10)) < 1.0 for x in losses[2:])
    assert len(set(losses)) == 4
