"""`engine.load_checkpoint` on checkpoints real DeepSpeed wrote (tests/fixtures/deepspeed): the engine
continues with the losses DeepSpeed itself had after the save, at the world size and stage that saved and
at another (one process with gradient accumulation over the same global batch, at ZeRO-3)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.testing.run_world import run_world

pytestmark = pytest.mark.dist

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"


def _fixture_module():
    spec = importlib.util.spec_from_file_location("ds_make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cases(dtype: str):
    out = []
    for path in sorted(FIXTURES.iterdir()):
        exp_file = path / "expected.json"
        if exp_file.is_file() and json.loads(exp_file.read_text())["dtype"] == dtype:
            out.append(path.name)
    return out


def _continue(case: str, stage: int | None):
    """Load `case` into a lightspeed engine (the saving stage, or `stage`) and run DeepSpeed's next steps."""
    exp = json.loads((FIXTURES / case / "expected.json").read_text())
    fixtures = _fixture_module()
    world, rank = dist.get_world_size(), dist.get_rank()
    saved_world = exp["world_size"]
    per_rank = saved_world // world  # micro-batches this rank runs per step
    config = json.loads(json.dumps(exp["config"]))
    config["gradient_accumulation_steps"] = per_rank
    config.pop("train_batch_size", None)
    if stage is not None:
        config["zero_optimization"] = {"stage": stage}
    model = fixtures.build_model()
    groups = fixtures.param_groups(model, exp["zero_stage"])
    engine, *_ = lightspeed.initialize(model=model, model_parameters=groups, config=config)
    engine.load_checkpoint(str(FIXTURES / case / "ckpt"))
    assert engine.global_steps == exp["counters"]["global_steps"]
    losses = []
    for batches in exp["next_batches"]:
        step_losses = []
        for i in range(per_rank):
            loss = engine(torch.tensor(batches[rank * per_rank + i]))
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        gathered = [None] * world
        dist.all_gather_object(gathered, step_losses)
        losses.append([x for part in gathered for x in part])
    want = exp["next_losses"]
    return [x for step in losses for x in step], [x for step in want for x in (step if isinstance(step, list) else [step])]


@pytest.mark.parametrize("case", _cases("fp32"))
def test_continues_with_deepspeeds_losses(case):
    exp = json.loads((FIXTURES / case / "expected.json").read_text())
    got, want = run_world(_continue, exp["world_size"], case, None)[0]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("case", ["ws2_stage2_fp32", "ws2_stage1_fp32", "ws2_stage0_fp32"])
def test_continues_at_another_world_size_and_stage(case):
    got, want = run_world(_continue, 1, case, 3)[0]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("case", ["ws2_stage2_bf16", "ws2_stage3_bf16"])
def test_bf16_continues_within_bf16_rounding(case):
    got, want = run_world(_continue, 2, case, None)[0]
    assert got == pytest.approx(want, rel=2e-2)
