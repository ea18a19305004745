"""`checkpoint.format: "deepspeed"` from a PipelineEngine: DeepSpeed's pipeline layout, resumed by lightspeed
and by real DeepSpeed 0.19.8.

World 2 (gloo): models A and B (tied embedding) of the pipeline fixtures (tests/fixtures/deepspeed_pipeline)
train at pp2, ZeRO-1, 3 steps, save in DeepSpeed's layout, and go on for 3 more (the reference); a second
pp2 engine loads the files and must continue with the reference's losses. Then DeepSpeed (its own
environment, lightspeed/testing/deepspeed_env.py, running tests/deepspeed/deepspeed_pipeline_worker.py)
loads the same files into its PipelineEngine and steps 4-6 must give the reference's losses (ZeRO-1: its
clipping norm is the global one, as lightspeed's). Skipped when the DeepSpeed environment is absent.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from lightspeed.testing.run_world import run_world
from tests.distributed.test_pipeline_checkpoints import FIXTURES, TOL, _engine, _expected, _train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

RUNS = (("A_pp2_z1", False), ("B_tied_pp2_z0", True))


def _write_and_read_back(tmp: str) -> dict:
    out = {}
    for run, tied in RUNS:
        writer = _engine(run, 2, 1, stage=1, fmt="deepspeed")
        _train(writer, run, range(3), tied=tied)
        writer.save_checkpoint(os.path.join(tmp, run))
        out[f"{run}_uninterrupted"] = _train(writer, run, range(3, 6), tied=tied)
        reader = _engine(run, 2, 1, stage=1)
        reader.load_checkpoint(os.path.join(tmp, run))
        out[f"{run}_read_back"] = _train(reader, run, range(3, 6), tied=tied)
        out[f"{run}_files"] = sorted(os.listdir(os.path.join(tmp, run, "global_step3")))
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("pipe_as_deepspeed"))
    return tmp, run_world(_write_and_read_back, 2, tmp, timeout=240)[0]


def test_lightspeed_reads_back_the_deepspeed_layout(written):
    _, out = written
    for run, _ in RUNS:
        assert out[f"{run}_read_back"] == pytest.approx(out[f"{run}_uninterrupted"], abs=TOL)
    # B: the tied embedding saved once, as layer 0 (its use at layer 5 runs through a forward_fn)
    assert out["B_tied_pp2_z0_files"] == [
        "layer_00-model_states.pt", "layer_01-model_states.pt", "layer_02-model_states.pt", "layer_03-model_states.pt",
        "layer_04-model_states.pt", "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"]
    assert "layer_01-model_states.pt" in out["A_pp2_z1_files"] and "layer_03-model_states.pt" not in out["A_pp2_z1_files"]


def test_deepspeed_resumes_pipeline_checkpoints_lightspeed_wrote(written, tmp_path):
    from lightspeed.testing import deepspeed_env

    python = deepspeed_env.python()
    if python is None:
        pytest.skip(deepspeed_env.missing_reason())
    tmp, out = written
    cases = []
    for run, tied in RUNS:
        config = json.loads(json.dumps(_expected(run)["config"]))
        config["zero_optimization"] = {"stage": 1}
        cases.append({"name": run, "tied": tied, "stages": 2, "config": config, "steps": [3, 4, 5],
                      "checkpoint": os.path.join(tmp, run)})
    spec = {"world_size": 2, "cases": cases, "fixtures": os.path.abspath(FIXTURES),
            "result": str(tmp_path / "deepspeed.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    worker = os.path.join(os.path.dirname(__file__), "..", "deepspeed", "deepspeed_pipeline_worker.py")
    done = subprocess.run([str(python), worker, str(tmp_path / "spec.json")], capture_output=True, text=True,
                          timeout=300, env=deepspeed_env.worker_env())
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "deepspeed.json").read_text())["cases"]
    for run, _ in RUNS:
        assert "error" not in results[run], results[run].get("error")
        assert results[run]["global_steps"] == 6
        assert results[run]["losses"] == pytest.approx(out[f"{run}_uninterrupted"], abs=TOL)
