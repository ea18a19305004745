"""Checkpoints of pipeline-parallel engines on real gloo processes, in three worlds (2, 1 and 4 ranks),
over the DeepSpeed pipeline fixtures' models and data (tests/fixtures/deepspeed_pipeline).

World 2: model A at pp2 (ZeRO-1) trains 3 steps, saves lightspeed's mesh layout, and goes on for 3
more (the uninterrupted reference); a second pp2 engine loads the tag and must continue with the same
losses; model B (tied embedding, ZeRO-1: its state partitioned over dp x pp) saves at pp2; DeepSpeed's
own pipeline checkpoints `A_pp2_z1` and `B_tied_pp2_z0` load into the pp2 engine (A: steps 4-6 give
DeepSpeed's `losses_after_resume`; B: the loaded weights and Adam state equal the files', as DeepSpeed's
ZeRO-0 clipping norm differs from lightspeed's, so later losses would not compare).
World 1: the pp2 tag loads at pp1 and continues as the pp2 run did; a pp1 run saves after 3 steps;
DeepSpeed's `A_pp2_z1` loads at pp1 and reproduces `losses_after_resume`; B's pp2 tag loads at pp1.
World 4: the pp1 tag loads at pp4 and the pp2 tag at pp2 x dp2 (both data-parallel ranks fed rank 0's
data, so the averaged gradient is the pp2 run's), each continuing with its reference's losses;
DeepSpeed's `A_pp2_dp2_z1` loads at pp2 x dp2 and reproduces its `losses_after_resume`.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepspeed_pipeline")
TOL = 1e-6


def _expected(run: str) -> dict:
    with open(os.path.join(FIXTURES, run, "expected.json")) as f:
        return json.load(f)


def _engine(run: str, pp: int, dp: int, *, tied: bool | None = None, stage: int | None = None):
    sys.path.insert(0, FIXTURES)
    import model as M  # the fixtures' models and data

    import lightspeed
    from lightspeed.parallel.pipeline import LayerSpec, PipelineModule, TiedLayerSpec

    exp = _expected(run)
    tied = exp["tied"] if tied is None else tied
    cfg = json.loads(json.dumps(exp["config"]))
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp
    if stage is not None:
        cfg["zero_optimization"] = {"stage": stage}
    net = PipelineModule(M.layer_specs(LayerSpec, TiedLayerSpec, tied), num_stages=pp, loss_fn=M.loss_fn(tied),
                         partition_method=exp["partition_method"], seed_layers=True, seed_fn=M.seed_layer,
                         base_seed=M.BASE_SEED)
    engine, *_ = lightspeed.initialize(model=net, config=cfg,
                                       model_parameters=[p for p in net.parameters() if p.requires_grad])
    return engine


def _train(engine, run: str, steps, *, tied: bool, data_rank: int = 0) -> list[float]:
    import model as M

    exp = _expected(run)
    out = []
    for step in steps:
        batch = [M.batches(step, m, exp["micro_batch"], exp["data_seed"], data_rank, tied)
                 for m in range(exp["gradient_accumulation_steps"])]
        out.append(float(engine.train_batch(iter(batch))))
    return out


def _deepspeed_tag(run: str) -> str:
    return os.path.join(FIXTURES, run, "ckpt")


def _world2(tmp: str):
    import torch.distributed as dist

    out = {}
    a = _engine("A_pp2_z1", 2, 1)
    out["A_first"] = _train(a, "A_pp2_z1", range(3), tied=False)
    a.save_checkpoint(os.path.join(tmp, "A_pp2"))
    out["A_uninterrupted"] = _train(a, "A_pp2_z1", range(3, 6), tied=False)
    resumed = _engine("A_pp2_z1", 2, 1)
    path, _ = resumed.load_checkpoint(os.path.join(tmp, "A_pp2"))
    out["A_counters"] = (resumed.global_steps, resumed.global_samples)
    out["A_resumed"] = _train(resumed, "A_pp2_z1", range(3, 6), tied=False)
    files = sorted(os.listdir(path))
    out["files"] = files

    b = _engine("B_tied_pp2_z0", 2, 1, stage=1)
    out["B_first"] = _train(b, "B_tied_pp2_z0", range(3), tied=True)
    b.save_checkpoint(os.path.join(tmp, "B_pp2"))
    out["B_uninterrupted"] = _train(b, "B_tied_pp2_z0", range(3, 6), tied=True)

    ds = _engine("A_pp2_z1", 2, 1)
    ds.load_checkpoint(_deepspeed_tag("A_pp2_z1"))
    out["DS_A_counters"] = (ds.global_steps, ds.global_samples)
    out["DS_A_resumed"] = _train(ds, "A_pp2_z1", range(3, 6), tied=False)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("pipe_ckpt"))
    two = run_world(_world2, 2, tmp, timeout=240)
    return {"tmp": tmp, "two": two}


def test_pp2_resumes_at_pp2(worlds):
    out = worlds["two"][0]
    assert out["A_first"] == pytest.approx(_expected("A_pp2_z1")["losses"][:3], abs=TOL)
    assert out["A_counters"] == (3, 24)
    assert out["A_resumed"] == pytest.approx(out["A_uninterrupted"], abs=TOL)
    assert "module_states_pp1.pt" in out["files"] and "optim_states_rank1.pt" in out["files"]


def test_deepspeed_pipeline_checkpoint_resumes(worlds):
    out = worlds["two"][0]
    ckpt = _expected("A_pp2_z1")["checkpoint"]
    assert out["DS_A_counters"] == (3, 24)
    assert out["DS_A_resumed"] == pytest.approx(ckpt["losses_after_resume"], abs=TOL)
