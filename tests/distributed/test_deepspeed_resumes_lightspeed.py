"""Real DeepSpeed 0.19.8 resumes what lightspeed saved, and lightspeed resumes what DeepSpeed saved next.

Per case: lightspeed trains TinyMLP 3 steps at ZeRO stage S (fp32 or bf16, 1 or 2 gloo ranks), saves
(``checkpoint.format: "deepspeed"``, or its own layout then ``write_deepspeed_checkpoint``), and trains 3
more steps: the reference. DeepSpeed (its own environment, lightspeed/testing/deepspeed_env.py, run by
tests/deepspeed/deepspeed_worker.py) loads the files into its engine with the same config, checks every
master and Adam moment equals lightspeed's exactly, takes step 4 and saves; lightspeed loads DeepSpeed's
files and takes steps 5 and 6. The losses of steps 4-6 equal the reference's. One DeepSpeed world per
world size runs all its cases. Skipped when the DeepSpeed environment is absent (.ci/run creates it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.checkpoint.convert import open_checkpoint
from lightspeed.checkpoint.deepspeed_writer import write_deepspeed_checkpoint
from lightspeed.testing import deepspeed_env
from lightspeed.testing.models import TinyMLP
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "deepspeed" / "deepspeed_worker.py"
MICRO, MICROS_PER_STEP, SAVE_AT, STEPS = 4, 2, 3, 6

# (name, lightspeed world, stage, dtype, how it is written, DeepSpeed world, DeepSpeed stage)
CASES = [
    ("w1_s0_fp32", 1, 0, "fp32", "convert", 1, 0),
    ("w1_s2_bf16", 1, 2, "bf16", "convert", 1, 2),
    ("w1_s3_fp32", 1, 3, "fp32", "convert", 1, 3),
    ("w2_s0_bf16", 2, 0, "bf16", "format", 2, 0),
    ("w2_s1_fp32", 2, 1, "fp32", "convert", 2, 1),
    ("w2_s2_fp32", 2, 2, "fp32", "format", 2, 2),
    ("w2_s3_bf16", 2, 3, "bf16", "format", 2, 3),
    # bf16 with fp32 gradient accumulation at stage 1: DeepSpeed's BF16_Optimizer loads the stage-1 files
    ("w2_s1_bf16acc32", 2, 1, "bf16acc32", "convert", 2, 1),
    # saved by 2 ranks at stage 2, written for 1 rank at stage 3 (--world-size): DeepSpeed needs its own
    ("w2_s2_fp32_to_w1_s3", 2, 2, "fp32", "convert", 1, 3),
]


def _config(stage: int, dtype: str, world: int, fmt: str = "lightspeed") -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": MICROS_PER_STEP // world,
        "train_batch_size": MICRO * MICROS_PER_STEP,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if dtype in ("bf16", "bf16acc32"):
        cfg["bf16"] = {"enabled": True}
    if dtype == "bf16acc32":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if fmt == "format":
        cfg["checkpoint"] = {"format": "deepspeed"}
        if stage == 2:  # the background writer: the conversion waits for its files
            cfg["checkpoint"]["writer"] = {"type": "PYTHON", "decoupled": True}
    return cfg


def _batches() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"x": [[torch.randn(MICRO, 13, generator=g) for _ in range(MICROS_PER_STEP)] for _ in range(STEPS)],
            "y": [[torch.randn(MICRO, 5, generator=g) for _ in range(MICROS_PER_STEP)] for _ in range(STEPS)]}


def _train(cases: list[tuple], batches: dict, work: str) -> dict:
    """In a lightspeed world: per case, the reference run (saving at SAVE_AT) or, when a DeepSpeed
    output is there, the continuation from it. Returns {name: losses per step (rank-major micro-batches)}."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = MICROS_PER_STEP // world
    out = {}
    for name, _, stage, dtype, how, _, _ in cases:
        model = TinyMLP()
        engine, *_ = lightspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=_config(stage, dtype, world, how))
        resume = Path(work, name, "deepspeed_out")
        first = 0
        if resume.is_dir():
            engine.load_checkpoint(str(resume))
            first = SAVE_AT + 1
            assert engine.global_steps == first
        lowp = torch.float32 if dtype == "fp32" else torch.bfloat16
        losses = []
        for step in range(first, STEPS):
            if step == SAVE_AT and first == 0:
                engine.save_checkpoint(str(Path(work, name, "lightspeed")))
            mine = []
            for i in range(rank * per_rank, (rank + 1) * per_rank):
                loss = engine(batches["x"][step][i].to(lowp), batches["y"][step][i])
                engine.backward(loss)
                engine.step()
                mine.append(loss.item())
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            losses.append([x for part in gathered for x in part])
        out[name] = losses
    return out


@pytest.fixture(scope="module")
def deepspeed_python():
    py = deepspeed_env.python()
    if py is None:
        pytest.skip(deepspeed_env.missing_reason())
    return py


def _expected_state(checkpoint: Path, path: Path) -> None:
    """What DeepSpeed must hold after the load: the masters and moments lightspeed saved."""
    src = open_checkpoint(checkpoint)
    torch.save({n: {k: src.read(n, k) for k in ("fp32", *src.state_keys())} for n in src.param_names()}, path)


def test_deepspeed_resumes_lightspeed_checkpoints_and_lightspeed_resumes_deepspeeds(tmp_path, deepspeed_python):
    batches = _batches()
    torch.save(batches, tmp_path / "batches.pt")
    reference: dict[str, list] = {}
    for world in (1, 2):
        reference.update(run_world(_train, world, [c for c in CASES if c[1] == world], batches, str(tmp_path),
                                   timeout=300)[0])
    ds_cases: dict[int, list[dict]] = {1: [], 2: []}
    for name, _, stage, dtype, how, ds_world, ds_stage in CASES:
        saved = tmp_path / name / "lightspeed"
        target = saved
        if how == "convert":
            target = tmp_path / name / "converted"
            write_deepspeed_checkpoint(saved, target, stage=ds_stage, world_size=ds_world)
        else:  # converted in place: DeepSpeed's files only, nothing of lightspeed's or of the conversion left
            assert sorted(os.listdir(saved)) == ["global_step3", "latest"]
            assert not any("zero" not in f and "mp_rank" not in f for f in os.listdir(saved / "global_step3"))
        # converted: what lightspeed saved; saved as DeepSpeed's files (in place): those files, as read back
        _expected_state(saved, tmp_path / name / "expected.pt")
        ds_cases[ds_world].append({
            "name": name, "checkpoint": str(target), "expected": str(tmp_path / name / "expected.pt"),
            "config": _config(ds_stage, dtype, ds_world), "dtype": dtype, "global_steps": SAVE_AT,
            "batches": str(tmp_path / "batches.pt"), "steps": [SAVE_AT], "output": str(tmp_path / name / "deepspeed_out")})
    deepspeed_losses = {}
    for ds_world, cases in ds_cases.items():
        spec = {"world_size": ds_world, "cases": cases, "models": str(ROOT / "lightspeed" / "testing" / "models.py"),
                "result": str(tmp_path / f"deepspeed_w{ds_world}.json")}
        (tmp_path / f"spec_w{ds_world}.json").write_text(json.dumps(spec))
        run = subprocess.run([str(deepspeed_python), str(WORKER), str(tmp_path / f"spec_w{ds_world}.json")],
                             capture_output=True, text=True, timeout=300, env=deepspeed_env.worker_env())
        assert run.returncode == 0, run.stderr[-3000:]
        results = json.loads(Path(spec["result"]).read_text())["cases"]
        for name, result in results.items():
            assert "error" not in result, f"DeepSpeed on {name}:\n{result.get('error')}"
            assert result["global_steps"] == SAVE_AT + 1
            deepspeed_losses[name] = result["losses"]
    continued: dict[str, list] = {}
    for world in (1, 2):
        continued.update(run_world(_train, world, [c for c in CASES if c[1] == world], batches, str(tmp_path),
                                   timeout=300)[0])
    for name, world, _, dtype, _, ds_world, _ in CASES:
        got = deepspeed_losses[name] + continued[name]
        want = reference[name][SAVE_AT:]
        # fp32: the same arithmetic up to summation order (another world size sums the micro-batches'
        # gradients in another order); bf16: both round to bf16 (DeepSpeed keeps bf16 gradients,
        # lightspeed its own accumulation), so the steps after the load agree to bf16 rounding
        tol = (dict(rel=2e-2) if dtype != "fp32" else dict(rel=1e-6, abs=1e-7) if ds_world == world
               else dict(rel=1e-5, abs=1e-6))
        assert [x for s in got for x in s] == pytest.approx([x for s in want for x in s], **tol), name
