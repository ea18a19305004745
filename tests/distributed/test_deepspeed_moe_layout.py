"""DeepSpeed's MoE checkpoint layout, without ZeRO both ways and written at ZeRO-2, on real gloo processes
(one lightspeed world of 2 ranks; DeepSpeed worlds of 2, one per ep size, when its environment is there).

The model is tests/fixtures/deepspeed_moe_checkpoint's (`Linear -> tanh -> MoE(4 experts, top-2, nothing
dropped) -> Linear`, MSE, DeepSpeed's MoE param groups, torch's AdamW). Read: DeepSpeed's own bf16 ep2
checkpoint resumes at ep2 with the losses DeepSpeed went on with. (Its fp32 ep2 and ep1 checkpoints
resume in worlds 1, 2 and 4: tests/distributed/test_moe_checkpoints.py.) Write: lightspeed trains 2
steps at ep2 (fp32), at ep1 (bf16, expert-data-parallel 2) and at ep2 ZeRO-2 (fp32) with
``checkpoint.format: "deepspeed"``, saves, and trains 2 more: the reference. The saved tags hold
DeepSpeed's files only, with its names; lightspeed reads the ep2 tag back at ep2 and at ep1 and goes on
with the reference's losses; a copy with a truncated expert file, and one whose two expert files are
swapped, fail to load with one CheckpointError line and leave the engine as it was. DeepSpeed 0.19.8
(its environment, tests/deepspeed/deepspeed_moe_worker.py) loads the three tags and its next losses are
the reference's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightspeed.testing import deepspeed_env
from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "deepspeed" / "deepspeed_moe_worker.py"
FIXTURES = ROOT / "tests" / "fixtures" / "deepspeed_moe_checkpoint"
D, SEQ, GLOBAL, EXPERTS, LR = 8, 4, 4, 4, 0.02
# name: (ep size, dtype, ZeRO stage)
WRITTEN = {"ep2_fp32": (2, "fp32", 0), "ep1_bf16": (1, "bf16", 0), "ep2_z2_fp32": (2, "fp32", 2)}


class Net(nn.Module):
    def __init__(self, ep: int):
        from lightspeed.parallel.experts import MoE

        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.moe = MoE(D, nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D)), num_experts=EXPERTS,
                       ep_size=ep, k=2, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                       min_capacity=0)
        self.head = nn.Linear(D, 1)

    def forward(self, x, y):
        out, _, _ = self.moe(torch.tanh(self.inp(x.to(self.inp.weight.dtype))))
        return F.mse_loss(self.head(out).squeeze(-1).float(), y)


def _batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL, SEQ, D, generator=gen), torch.randn(GLOBAL, SEQ, generator=gen)


def _engine(ep: int, dtype: str, fmt: str = "lightspeed", stage: int = 0):
    import lightspeed
    from lightspeed.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import torch.distributed as dist

    config = {"train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(), "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "checkpoint": {"format": fmt}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    model = Net(ep)
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "dense"})
    engine, *_ = lightspeed.initialize(model=model, model_parameters=params, config=config)
    return engine


def _train(engine, steps) -> list[float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL // world
    out = []
    for step in steps:
        x, y = _batch(step)
        loss = engine(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        out.append(float(total) / world)
    return out


def _failed_load(engine, path: str) -> dict:
    from lightspeed.checkpoint.errors import CheckpointError

    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    try:
        engine.load_checkpoint(path)
        error = "loaded"
    except CheckpointError as err:
        error = str(err)
    unchanged = all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())
    return {"error": error, "unchanged": unchanged}


def _world(tmp: str) -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict = {"files": {}}
    engine = _engine(2, "bf16")
    engine.load_checkpoint(str(FIXTURES / "ep2_z0_bf16"))
    out["deepspeed_bf16"] = _train(engine, range(2, 4))
    for name, (ep, dtype, stage) in WRITTEN.items():
        engine = _engine(ep, dtype, "deepspeed", stage)
        _train(engine, range(2))
        engine.save_checkpoint(os.path.join(tmp, name), tag="global_step2")
        out[name] = _train(engine, range(2, 4))
        out["files"][name] = sorted(os.listdir(os.path.join(tmp, name, "global_step2")))
    written = os.path.join(tmp, "ep2_fp32")
    for ep in (2, 1):
        engine = _engine(ep, "fp32")
        engine.load_checkpoint(written)
        out[f"read_back_ep{ep}"] = _train(engine, range(2, 4))
    if rank == 0:
        tag = os.path.join(written, "global_step2")
        shutil.copytree(tag, os.path.join(tmp, "truncated", "global_step2"))
        with open(os.path.join(tmp, "truncated", "global_step2", "layer_0_expert_3_mp_rank_00_model_states.pt"),
                  "r+b") as f:
            f.truncate(200)
        swapped = os.path.join(tmp, "swapped", "global_step2")
        shutil.copytree(tag, swapped)
        first, second = (os.path.join(swapped, f"layer_0_expert_{g}_mp_rank_00_model_states.pt") for g in (1, 2))
        os.replace(first, first + ".tmp")
        os.replace(second, first)
        os.replace(first + ".tmp", second)
    dist.barrier()
    engine = _engine(2, "fp32")
    for bad in ("truncated", "swapped"):
        out[bad] = _failed_load(engine, os.path.join(tmp, bad, "global_step2"))
    return out


@pytest.fixture(scope="module")
def lightspeed_world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_layout")
    return tmp, run_world(_world, 2, str(tmp), timeout=240)


def test_deepspeed_bf16_checkpoint_resumes(lightspeed_world):
    _, results = lightspeed_world
    expected = json.loads((FIXTURES / "ep2_z0_bf16" / "expected.json").read_text())["losses_after_resume"]
    for result in results:
        # bf16 on both sides, the same arithmetic (equal to the last bit when written)
        assert result["deepspeed_bf16"] == pytest.approx(expected, abs=1e-5, rel=0)


def test_written_layout_is_deepspeeds(lightspeed_world):
    _, results = lightspeed_world
    for name, (ep, _, stage) in WRITTEN.items():
        assert results[0]["files"][name] == sorted(
            ([f"expp_rank_{e}_mp_rank_00_optim_states.pt" for e in range(ep)] if stage == 0
             else [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)])
            + [f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(EXPERTS)]
            + ["mp_rank_00_model_states.pt"])
    tmp, _ = lightspeed_world
    tag = tmp / "ep2_fp32" / "global_step2"
    model = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    assert model["num_experts"] == [EXPERTS] and model["ds_autoep_layers"] is None
    assert not any("deepspeed_experts" in k for k in model["module"])
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    assert list(torch.load(tag / "layer_0_expert_3_mp_rank_00_model_states.pt", weights_only=True)) == [
        f"{prefix}3.{k}" for k in ("0.weight", "0.bias", "2.weight", "2.bias")]
    optim = torch.load(tag / "expp_rank_1_mp_rank_00_optim_states.pt", weights_only=False)["optimizer"]
    assert [(g["name"], g.get("moe", False), len(g["params"])) for g in optim["param_groups"]] == [
        ("dense", False, 5), ("ep_size_2", True, 8)]


def test_lightspeed_reads_the_written_layout_back(lightspeed_world):
    _, results = lightspeed_world
    for result in results:
        for ep in (2, 1):
            assert result[f"read_back_ep{ep}"] == pytest.approx(result["ep2_fp32"], abs=1e-6, rel=0)


@pytest.mark.parametrize("bad", ["truncated", "swapped"])
def test_bad_expert_file_is_refused(lightspeed_world, bad):
    _, results = lightspeed_world
    for result in results:
        error = result[bad]["error"]
        assert error != "loaded" and "layer_0_expert_" in error and "\n" not in error, error
        assert result[bad]["unchanged"]


def test_deepspeed_resumes_the_written_layout(lightspeed_world):
    py = deepspeed_env.python()
    if py is None:
        pytest.skip(deepspeed_env.missing_reason())
    tmp, results = lightspeed_world
    spec = {"world_size": 2, "result": str(tmp / "deepspeed.json"),
            "cases": [{"name": name, "checkpoint": str(tmp / name), "ep": ep, "dtype": dtype, "stage": stage,
                       "steps": [2, 3]} for name, (ep, dtype, stage) in WRITTEN.items()]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([str(py), str(WORKER), str(tmp / "spec.json")], capture_output=True, text=True,
                         timeout=240, env=deepspeed_env.worker_env())
    assert run.returncode == 0, run.stderr[-3000:]
    for name, (_, dtype, _) in WRITTEN.items():
        ranks = [json.loads((tmp / f"deepspeed.json.{name}.{r}").read_text()) for r in range(2)]
        for rank, result in enumerate(ranks):
            assert "error" not in result, f"DeepSpeed rank {rank} on {name}:\n{result['error']}"
        assert ranks[0]["global_steps"] == 4
        # the same arithmetic on both sides (bf16 too: the losses were equal to the last bit when written)
        tol = dict(abs=1e-5, rel=0) if dtype == "bf16" else dict(abs=1e-6, rel=0)
        assert ranks[0]["losses"] == pytest.approx(results[0][name], **tol), name
