"""DeepSpeed 0.19.8's own checkpoints of AutoEP training (tests/fixtures/deepspeed_autoep_checkpoint: a
tiny Mixtral at world 2, saved after 2 steps: ep2 without ZeRO, ep2 at ZeRO-2, ep1 at ZeRO-2) loaded by
lightspeed's `engine.load_checkpoint`, in one world of 2 gloo processes, each resume then taking the
two steps DeepSpeed took after its save, with DeepSpeed's losses (1e-5):

- ep2 ZeRO-0 into AutoEP at autoep_size 2, ZeRO-0; ep2 ZeRO-2 into AutoEP at autoep_size 1, ZeRO-2
  (another ep size); ep1 ZeRO-2 into the plain Hugging Face model (no AutoEP), ZeRO-1.
- errors: a tag missing an expert file, and one whose expert file holds another expert: one line
  naming the file, raised on every rank, the engine unchanged.
- writing (`checkpoint.format: "deepspeed"`): AutoEP at autoep_size 2 trains 2 steps, saves DeepSpeed's
  AutoEP layout and goes on 2 steps: the Mixtral at ZeRO-2 (clipping 1.0) from DeepSpeed's initial
  weights (its first 2 losses are the fixture's; its files have the fixture's names, param shapes and
  ds_autoep_layers), and a Qwen2-MoE (a shared expert and its gate: DeepSpeed renames them) at ZeRO-0
  (no clipping). lightspeed reads each tag back into the plain model (ZeRO-1) and takes the same 2
  steps, and real DeepSpeed (tests/deepspeed/deepspeed_autoep_worker.py, in its own environment)
  resumes both with lightspeed's losses (1e-5).
(The reader alone: tests/unit/checkpoint/test_deepspeed_autoep.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lightspeed.testing import deepspeed_env
from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepspeed_autoep_checkpoint")
WORKER = Path(__file__).resolve().parents[1] / "deepspeed" / "deepspeed_autoep_worker.py"
SEQ, MICRO, VOCAB, LR = 6, 2, 64, 0.01
# (fixture, autoep_size here (0: no AutoEP), ZeRO stage here)
RESUMES = (("ep2_z0", 2, 0), ("ep2_z2", 1, 2), ("ep1_z2", 0, 1))
# written by lightspeed at autoep_size 2: name -> (model, ZeRO stage, gradient clipping)
WRITTEN = {"written_z2": ("mixtral", 2, 1.0), "written_z0_qwen": ("qwen2_moe", 0, 0.0)}
PRESET = {"mixtral": "mixtral", "qwen2_moe": "qwen3_moe"}  # DeepSpeed's presets' names


def _model(seed: int = 1, name: str = "mixtral"):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, initializer_range=0.2)
    torch.manual_seed(seed)  # 1: other weights than DeepSpeed's (the load must replace every one); 0: DeepSpeed's
    if name == "qwen2_moe":  # a shared expert and its gate (tests/deepspeed/deepspeed_autoep_worker.py's)
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, **common)).float()
    return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                  **common)).float()


def _engine(autoep: int, stage: int, clip: float = 1.0, fmt: str = "lightspeed", seed: int = 1,
            model: str = "mixtral"):
    import lightspeed

    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": stage},
              "gradient_clipping": clip,  # the fixture's (1.0: DeepSpeed 0.19.8's default)
              "checkpoint": {"format": fmt}}
    if autoep:
        config["expert_parallel"] = {"enabled": True, "autoep_size": autoep, "preset_model": PRESET[model]}
    engine, *_ = lightspeed.initialize(model=_model(seed, model), config=config)
    return engine


def _train(engine, steps) -> list[float]:
    """The global batch's mean loss at each step (the fixture's batches)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(11 + step)
        ids = torch.randint(0, VOCAB, (world * MICRO, SEQ), generator=gen)[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _world(tmp: str):
    import torch.distributed as dist

    from lightspeed.checkpoint.errors import CheckpointError

    rank = dist.get_rank()
    out: dict = {}
    for run, autoep, stage in RESUMES:
        with open(os.path.join(FIXTURES, run, "expected.json")) as f:
            clip = json.load(f)["gradient_clipping"]
        engine = _engine(autoep, stage, clip)
        engine.load_checkpoint(os.path.join(FIXTURES, run))
        out[f"{run}->{autoep},{stage}"] = _train(engine, range(2, 4))
    tag = os.path.join(FIXTURES, "ep2_z2", "global_step2")
    if rank == 0:
        for bad in ("missing", "swapped"):
            shutil.copytree(tag, os.path.join(tmp, bad, "global_step2"))
        os.remove(os.path.join(tmp, "missing", "global_step2", "layer_1_expert_3_mp_rank_00_model_states.pt"))
        shutil.copy(os.path.join(tag, "layer_1_expert_2_mp_rank_00_model_states.pt"),
                    os.path.join(tmp, "swapped", "global_step2", "layer_1_expert_3_mp_rank_00_model_states.pt"))
    dist.barrier()
    engine = _engine(2, 2)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    for bad in ("missing", "swapped"):
        try:
            engine.load_checkpoint(os.path.join(tmp, bad), tag="global_step2")
            out[bad] = "loaded"
        except CheckpointError as err:
            out[bad] = str(err)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())
    for name, (model, stage, clip) in WRITTEN.items():
        engine = _engine(2, stage, clip, fmt="deepspeed", seed=0, model=model)
        out[name] = _train(engine, range(2))
        engine.save_checkpoint(os.path.join(tmp, name), tag="global_step2")
        out[name] += _train(engine, range(2, 4))
        engine = _engine(0, 1, clip, model=model)  # the plain model reads it back
        engine.load_checkpoint(os.path.join(tmp, name))
        out[f"{name} read back"] = _train(engine, range(2, 4))
    return out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("ds_autoep")


@pytest.fixture(scope="module")
def world(tmp):
    return run_world(_world, 2, str(tmp), timeout=240)


@pytest.mark.parametrize("run,autoep,stage", RESUMES)
def test_resume_follows_deepspeed(world, run, autoep, stage):
    with open(os.path.join(FIXTURES, run, "expected.json")) as f:
        expected = json.load(f)["losses_after_resume"]
    for result in world:
        assert result[f"{run}->{autoep},{stage}"] == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_bad_files_change_nothing(world):
    for result in world:
        assert "layer_1_expert_3_mp_rank_00_model_states.pt: missing" in result["missing"], result["missing"]
        assert "mismatched expert file" in result["swapped"] and "\n" not in result["swapped"], result["swapped"]
        assert result["unchanged"]



def test_written_layout_is_deepspeeds(world, tmp):
    with open(os.path.join(FIXTURES, "ep2_z2", "expected.json")) as f:
        before = json.load(f)["losses_before_save"]
    for result in world:
        assert result["written_z2"][:2] == pytest.approx(before, rel=1e-5, abs=1e-5)
        for name in WRITTEN:
            assert result[f"{name} read back"] == pytest.approx(result[name][2:], rel=0, abs=1e-6), name
    ours, theirs = (sorted(os.listdir(d)) for d in (tmp / "written_z2" / "global_step2",
                                                     Path(FIXTURES) / "ep2_z2" / "global_step2"))
    assert ours == theirs
    tag = tmp / "written_z2" / "global_step2"
    model = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    fixture = torch.load(Path(FIXTURES) / "ep2_z2" / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    assert list(model["module"]) == list(fixture["module"])
    assert model["num_experts"] == fixture["num_experts"]
    assert model["ds_autoep_layers"] == fixture["ds_autoep_layers"]
    assert [list(g) for g in model["param_shapes"]] == [list(g) for g in fixture["param_shapes"]]


def test_deepspeed_resumes_the_written_layout(world, tmp):
    py = deepspeed_env.python()
    if py is None:
        pytest.skip(deepspeed_env.missing_reason())
    spec = {"world_size": 2, "result": str(tmp / "deepspeed.json"),
            "cases": [{"name": name, "model": model, "checkpoint": str(tmp / name), "ep": 2, "stage": stage,
                       "clip": clip, "steps": [2, 3]} for name, (model, stage, clip) in WRITTEN.items()]}
    (tmp / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([str(py), str(WORKER), str(tmp / "spec.json")], capture_output=True, text=True,
                         timeout=240, env=deepspeed_env.worker_env())
    assert run.returncode == 0, run.stderr[-3000:]
    for name in WRITTEN:
        ranks = [json.loads((tmp / f"deepspeed.json.{name}.{r}").read_text()) for r in range(2)]
        for rank, result in enumerate(ranks):
            assert "error" not in result, f"DeepSpeed rank {rank} on {name}:\n{result['error']}"
        assert ranks[0]["global_steps"] == 4
        assert ranks[0]["losses"] == pytest.approx(world[0][name][2:], rel=1e-5, abs=1e-5), name
