"""`lightspeed --as_deepspeed --num_procs 2 script.py`: an unchanged DeepSpeed script runs on lightspeed,
its losses those of plain PyTorch on the whole batch from the same initial weights."""

import json

import pytest
import torch

from lightspeed.launcher.local import NodePlan, worker_command
from lightspeed.launcher.node import node_command
from lightspeed.zero.stage3 import initialize_module_weights
from lightspeed.zero.stage3.init import seed_from_global_rng

from .conftest import SCRIPTS, run_cli

STEPS, MICRO, WORLD, LR = 5, 4, 2, 0.01


def _reference_losses(zero_init: bool) -> list[float]:
    """The script's run on one process: the whole global batch, torch.optim.Adam, clipping at 1.0, the same initial
    weights (under zero.Init: its rule, with the seed the script's Init draws; else torch's)."""
    torch.manual_seed(1234)
    seed = seed_from_global_rng()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if zero_init:
        initialize_module_weights(model, seed)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x = torch.randn(MICRO * WORLD, 8, generator=torch.Generator().manual_seed(7))
    y = x.sum(dim=1, keepdim=True).sin()
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.no_real_deepspeed
@pytest.mark.dist
@pytest.mark.parametrize("stage", [3])
def test_unchanged_deepspeed_script_runs_through_the_launcher(tmp_path, home, stage):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 100,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
    }))
    out = tmp_path / "result.json"
    logs = tmp_path / "logs"
    proc = run_cli(["--as_deepspeed", "--num_procs", WORLD, "--enable_each_rank_log", logs,
                    SCRIPTS / "deepspeed_style_train.py", "--deepspeed_config", config, "--steps", STEPS, "--out", out],
                   tmp_path, home, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:] + "".join(f"\n== {p.name}\n{p.read_text()[-2000:]}"
                                                              for p in sorted(logs.glob("*.log")))
    result = json.loads(out.read_text())
    assert result["version"] == "0.19.8" and result["engine"] == "LightspeedEngine"
    assert result["accelerator"] == "cpu" and result["overflow"] is False
    expected = _reference_losses(zero_init=stage == 3)
    assert result["losses"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert expected[-1] < expected[0]


def test_worker_command_runs_the_script_through_as_deepspeed(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--local_rank')\n")
    plan = NodePlan(world_info={"localhost": [0, 1]}, node_rank=0, script=str(script), script_args=["--x", "1"],
                    as_deepspeed=True)
    cmd = worker_command(plan)
    assert cmd[1:5] == ["-u", "-m", "lightspeed.as_deepspeed", str(script)]
    assert cmd[5:] == ["--local_rank=${local_rank}", "--x", "1"]
    plan.module, plan.script = True, "pkg.train"
    assert worker_command(plan)[1:6] == ["-u", "-m", "lightspeed.as_deepspeed", "-m", "pkg.train"]
    assert "--as_deepspeed" in node_command(plan, "0")  # multi-node: every node's agent passes it on


def test_as_deepspeed_refuses_no_python(cli, tmp_path):
    code, _, err = cli("--as_deepspeed", "--no_python", "--num_procs", "2", "ls")
    assert code == 2
    assert "--as_deepspeed runs a Python script; it cannot be used with --no_python" in err


@pytest.mark.no_real_deepspeed
@pytest.mark.dist
def test_accelerate_launch_form_registers_in_the_launcher_and_every_worker(tmp_path, home):
    """README's form for `accelerate launch --use_deepspeed`: its launcher process checks for DeepSpeed
    itself, then starts the workers through torch.distributed.run."""
    import subprocess
    import sys

    from .conftest import clean_env

    (tmp_path / "check.py").write_text(
        "import os, sys\nfrom accelerate.utils import is_deepspeed_available\nimport deepspeed\n"
        "open(f\"worker{os.environ['RANK']}.txt\", 'w').write(\n"
        "    f'{is_deepspeed_available()} {deepspeed.__version__} {sys.argv[1:]}')\n")
    proc = subprocess.run([sys.executable, "-m", "lightspeed.as_deepspeed", "-m", "accelerate.commands.launch",
                           "--use_deepspeed", "--zero_stage", "1", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", "--module", "lightspeed.as_deepspeed",
                           "check.py", "--foo", "1"], cwd=tmp_path, env=clean_env(home), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each worker writes its own file: two workers printing to one pipe can interleave even inside a line
    workers = [(tmp_path / f"worker{r}.txt").read_text() for r in range(2)]
    assert workers == ["True 0.19.8 ['--foo', '1']"] * 2
