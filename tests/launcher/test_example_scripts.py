"""DeepSpeedExamples' CIFAR-10 tutorial (tests/fixtures/deepspeedexamples_cifar: its data made
synthetic, README.md there) unchanged under `lightspeed --as_deepspeed` on 2 CPU processes (gloo), as
its `run_ds.sh` and `run_ds_moe.sh` run it: each must train, evaluate and exit 0."""

import math
import re

import pytest

from .conftest import REPO, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.no_real_deepspeed, pytest.mark.timeout(300)]

SCRIPT = REPO / "tests" / "fixtures" / "deepspeedexamples_cifar" / "cifar10_deepspeed.py"


def _run(tmp_path, home, *args):
    proc = run_cli(["--as_deepspeed", "--num_procs", 2, SCRIPT, "--deepspeed", "--epochs", 1, "--log-interval", 10,
                    *args], tmp_path, home, timeout=240, LIGHTSPEED_ACCELERATOR="cpu",
                   SYNTHETIC_CIFAR_LENGTH="640", SYNTHETIC_CIFAR_TEST_LENGTH="40")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "registered lightspeed as deepspeed" in out and out.count("Finished Training") == 2, out[-4000:]
    assert re.search(r"Accuracy of the network on the 40 test images: +\d+ %", out), out[-4000:]
    # rank 1's "Finished Training" may land inside rank 0's last line (print writes the line end apart)
    losses = [float(v) for v in re.findall(r"\[ 1, +\d+\] loss: +(\d+\.\d{3})", out)]
    assert len(losses) == 4 and all(math.isfinite(x) and x < math.log(10) + 0.5 for x in losses), out[-4000:]
    assert abs(losses[0] - math.log(10)) < 0.3, out[-4000:]  # the first 10 steps: about uniform
    return out, losses


def test_cifar10_tutorial_as_run_ds_sh_runs_it(tmp_path, home):
    """The script's defaults: fp16 with dynamic loss scaling, ZeRO stage 0, gradient clipping, WarmupLR."""
    out, losses = _run(tmp_path, home)
    assert "torch.float16 params" in out and "micro batch 8 x 1 accumulation steps = 16 global" in out
    assert losses[-1] < losses[0] - 0.05  # 40 steps of 16: the class patterns are learnt


def test_cifar10_tutorial_with_moe_as_run_ds_moe_sh_runs_it(tmp_path, home):
    out, _ = _run(tmp_path, home, "--dtype", "fp32", "--stage", 2, "--moe", "--ep-world-size", 2, "--num-experts", 2,
                  "--top-k", 1, "--noisy-gate-policy", "RSample", "--moe-param-group")
    assert "MoE layer: 2 experts, 1 per rank, expert-parallel size 2" in out and "ZeRO stage 2" in out
