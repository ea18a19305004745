"""Checkpoints of expert-parallel training on real gloo processes, in three worlds (2, 4, then 1 rank).

A DeepSpeed-style MoE model (dense layer, `MoE` of 4 top-2 experts without drops, dense head, MSE:
the same math whatever the split of the global batch) trains at ep2 (ZeRO-1) for 3 steps, saves, and
goes on for 3 more: the uninterrupted reference. World 2: a fresh ep2 engine first fails to load a
copy of the tag whose rank-1 optimizer file is truncated (every rank raises, nothing changes), then
loads the tag and continues with the reference's losses (1e-6); an AutoEP Mixtral (autoep_size 2,
ZeRO-1) trains 2 steps and saves. World 4: ep2 x dp2 resumes at ZeRO-3 and at ZeRO-0 (the reference's
losses, 1e-5), each saving again. World 1: ep1 (ZeRO-2, the whole batch a micro-batch) resumes (1e-5);
the ep2 tag and the ep2 x dp2 ZeRO-3 and ZeRO-0 tags consolidate (`zero_to_fp32`) to the ep1 model's
names and per-global-expert tensors, equal to each other within 1e-5 (the ep2 run's `save_16bit_model`,
float32 training, and an ep1 engine's module-only load of the ep2 tag equal to it exactly); the AutoEP
tag loads at autoep_size 1 and gives the ep2 run's logits (1e-5), and consolidates to the whole model's
fused [E, ...] tensors (equal to the loaded ones). In every world, DeepSpeed's own MoE
checkpoints (tests/fixtures/deepspeed_moe_checkpoint: ep2 ZeRO-1, ep2 x dp2 ZeRO-2, ep2 and ep1 without
ZeRO) resume (at ep2 ZeRO-1, ep2 x dp2 ZeRO-2, ep1 ZeRO-0) with the losses DeepSpeed went on with (1e-5).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightspeed.testing.models import distinct_experts
from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

D, SEQ, GLOBAL, EXPERTS, LR = 8, 4, 4, 4, 0.02
PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."
DEEPSPEED = os.path.join(os.path.dirname(__file__), "..", "fixtures", "deepspeed_moe_checkpoint")
# DeepSpeed's fp32 runs (ep2_z0_bf16: tests/distributed/test_deepspeed_moe_layout.py)
DEEPSPEED_RUNS = ["ep2_z1", "ep2_dp2_z2", "ep2_z0", "ep1_z0"]


class MoENet(nn.Module):
    """Linear -> tanh -> MoE (top-2, nothing dropped) -> linear head; MSE (no aux loss: its value
    depends on how the batch is split)."""

    def __init__(self, ep_size: int, ep_rank: int):
        from lightspeed.parallel.experts import MoE

        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        expert = nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D))
        self.moe = MoE(D, expert, num_experts=EXPERTS, ep_size=ep_size, k=2, drop_tokens=False, use_rts=False,
                       top2_2nd_expert_sampling=False, min_capacity=0)
        self.head = nn.Linear(D, 1)
        distinct_experts(self.moe, ep_rank)  # experts differ by their global index

    def forward(self, x, y):
        out, _, _ = self.moe(torch.tanh(self.inp(x)))
        return F.mse_loss(self.head(out).squeeze(-1), y)


def _batch(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL, SEQ, D, generator=gen), torch.randn(GLOBAL, SEQ, generator=gen)


def _engine(ep: int, stage: int, groups: bool = False):
    """`groups`: DeepSpeed's MoE optimizer groups (dense, experts) and torch's AdamW, as DeepSpeed's fixtures
    were trained."""
    import torch.distributed as dist

    import lightspeed
    from lightspeed.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    world = dist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": GLOBAL // world, "gradient_accumulation_steps": 1,
              "steps_per_print": 1000, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage}}
    if groups:  # and DeepSpeed's optimizer: torch's AdamW
        config["optimizer"]["params"]["torch_adam"] = True
    model = MoENet(ep, dist.get_rank() % ep)
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "dense"}) if groups else None
    engine, *_ = lightspeed.initialize(model=model, model_parameters=params, config=config)
    return engine


def _deepspeed_resumes(ep: int, stage: int) -> dict[str, list[float]]:
    """Each of DeepSpeed's MoE checkpoints loaded here, then steps 2-3 (DeepSpeed's own went on the same)."""
    out = {}
    for run in DEEPSPEED_RUNS:
        if os.path.isdir(os.path.join(DEEPSPEED, run)):
            engine = _engine(ep, stage, groups=True)
            engine.load_checkpoint(os.path.join(DEEPSPEED, run))
            out[run] = _train(engine, range(2, 4))
    return out


def _train(engine, steps) -> list[float]:
    """The global batch's mean loss at each step (each rank and micro-batch an equal share)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL // world
    out = []
    for step in steps:
        x, y = _batch(step)
        loss = engine(x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        out.append(float(total) / world)
    return out


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _mixtral():
    import transformers as tf

    torch.manual_seed(0)
    return tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        initializer_range=0.2)).float()


def _autoep(size: int):
    import lightspeed

    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 1}, "expert_parallel": {"enabled": True, "autoep_size": size}}
    engine, *_ = lightspeed.initialize(model=_mixtral(), config=config)
    return engine


def _ids(step: int):
    return torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(5 + step))


def _logits(engine):
    engine.eval()
    with torch.no_grad():
        return engine(input_ids=_ids(99)).logits


def _world2(tmp: str):
    import torch.distributed as dist

    from lightspeed.checkpoint.errors import CheckpointError

    rank = dist.get_rank()
    ref = _engine(2, 1)
    _train(ref, range(3))
    ref.save_checkpoint(tmp, tag="t3")
    out = {"reference": _train(ref, range(3, 6))}
    ref.save_checkpoint(tmp, tag="t6")
    ref.save_16bit_model(os.path.join(tmp, "weights"))
    if rank == 0:
        shutil.copytree(os.path.join(tmp, "t3"), os.path.join(tmp, "bad"))
        with open(os.path.join(tmp, "bad", "optim_states_rank1.pt"), "r+b") as f:
            f.truncate(100)
    dist.barrier()
    resumed = _engine(2, 1)
    before = _snapshot(resumed)
    try:
        resumed.load_checkpoint(tmp, tag="bad")
        out["bad"] = "loaded"
    except CheckpointError as err:
        out["bad"] = str(err)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in _snapshot(resumed).items())
    resumed.load_checkpoint(tmp, tag="t3")
    out["same_layout"] = _train(resumed, range(3, 6))
    out["deepspeed"] = _deepspeed_resumes(2, 1)
    auto = _autoep(2)
    for step in range(2):
        ids = _ids(step)[rank:rank + 1].repeat(2, 1)
        loss = auto(input_ids=ids, labels=ids).loss
        auto.backward(loss)
        auto.step()
    auto.save_checkpoint(tmp, tag="auto")
    out["auto_logits"] = _logits(auto)
    return out


def _world4(tmp: str):
    out = {"deepspeed": _deepspeed_resumes(2, 2)}
    for stage in (3, 0):
        engine = _engine(2, stage)
        engine.load_checkpoint(tmp, tag="t3")
        out[stage] = _train(engine, range(3, 6))
        engine.save_checkpoint(tmp, tag=f"t6_z{stage}_ep2dp2")
    return out


def _world1(tmp: str):
    from lightspeed.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = {"deepspeed": _deepspeed_resumes(1, 0)}
    engine = _engine(1, 2)
    engine.load_checkpoint(tmp, tag="t3")
    out.update(ep1=_train(engine, range(3, 6)), ep1_state=_snapshot(engine))
    out["fp32"] = {k: v.contiguous().clone() for k, v in
                   get_fp32_state_dict_from_zero_checkpoint(tmp, tag="t6").items()}
    for stage in (3, 0):
        out[f"fp32_z{stage}"] = {k: v.contiguous().clone() for k, v in
                                 get_fp32_state_dict_from_zero_checkpoint(tmp, tag=f"t6_z{stage}_ep2dp2").items()}
    weights_only = _engine(1, 1)
    weights_only.load_checkpoint(tmp, tag="t6", load_module_only=True)
    out["module_only"] = _snapshot(weights_only)
    out["weights"] = torch.load(os.path.join(tmp, "weights", "pytorch_model.bin"), weights_only=True)
    auto = _autoep(1)
    auto.load_checkpoint(tmp, tag="auto")
    out["auto_logits"] = _logits(auto)
    out["auto_state"] = _snapshot(auto)
    out["auto_fp32"] = {k: v.contiguous().clone() for k, v in
                        get_fp32_state_dict_from_zero_checkpoint(tmp, tag="auto").items()}
    return out


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("moe_ckpt"))
    two = run_world(_world2, 2, tmp, timeout=240)
    four = run_world(_world4, 4, tmp, timeout=240)
    one = run_world(_world1, 1, tmp, timeout=240)
    return two, four, one[0]


def test_failed_load_changes_nothing(worlds):
    two, _, _ = worlds
    for rank, result in enumerate(two):
        assert result["bad"] != "loaded" and "rank" in result["bad"], result["bad"]
        assert result["unchanged"], rank


def test_resume_at_the_same_layout(worlds):
    two, _, _ = worlds
    for result in two:
        assert result["same_layout"] == pytest.approx(two[0]["reference"], abs=1e-6, rel=0)


@pytest.mark.parametrize("stage", [3, 0])
def test_resume_at_ep2_dp2(worlds, stage):
    two, four, _ = worlds
    for result in four:
        assert result[stage] == pytest.approx(two[0]["reference"], abs=1e-5, rel=0)


def test_resume_at_ep1(worlds):
    two, _, one = worlds
    assert one["ep1"] == pytest.approx(two[0]["reference"], abs=1e-5, rel=0)


def test_consolidated_by_global_expert(worlds):
    _, _, one = worlds
    fp32 = one["fp32"]
    names = set(one["ep1_state"])
    assert set(fp32) == names and set(one["fp32_z0"]) == names and set(one["fp32_z3"]) == names  # ep1's names
    assert {k for k in fp32 if k.startswith(PREFIX)} == {f"{PREFIX}{g}.{r}" for g in range(EXPERTS)
                                                         for r in ("0.weight", "0.bias", "2.weight", "2.bias")}
    assert set(one["weights"]) == names  # save_16bit_model at ep2: every expert, under ep1's names
    for key, value in fp32.items():
        torch.testing.assert_close(one["weights"][key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
        torch.testing.assert_close(one["module_only"][key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
        assert value.shape == one["ep1_state"][key].shape, key
        # both runs trained steps 4-6 from the same tag on the same global batches
        for stage in (3, 0):
            torch.testing.assert_close(one[f"fp32_z{stage}"][key], value, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{key}: {m}")
        torch.testing.assert_close(one["ep1_state"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_autoep_tag_loads_at_autoep_size_1(worlds):
    two, _, one = worlds
    torch.testing.assert_close(two[0]["auto_logits"], two[1]["auto_logits"])
    torch.testing.assert_close(one["auto_logits"], two[0]["auto_logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("run", DEEPSPEED_RUNS)
def test_deepspeed_moe_checkpoint_resumes(worlds, run):
    """DeepSpeed's own MoE checkpoints (ep2 ZeRO-1, ep2 x dp2 ZeRO-2, and without ZeRO ep2 and ep1) resume at
    ep2 ZeRO-1, ep2 x dp2 ZeRO-2 and ep1 ZeRO-0 with the losses DeepSpeed's run went on with."""
    import json

    with open(os.path.join(DEEPSPEED, run, "expected.json")) as f:
        expected = json.load(f)["losses_after_resume"]
    two, four, one = worlds
    for result in [*two, *four, one]:
        assert result["deepspeed"][run] == pytest.approx(expected, abs=1e-5, rel=0)


def test_autoep_tag_consolidates_to_the_whole_model(worlds):
    _, _, one = worlds
    whole = {k: v.shape for k, v in _mixtral().state_dict().items()}
    fused = [k for k in one["auto_fp32"] if k.endswith("experts.gate_up_proj")]
    assert fused and all(one["auto_fp32"][k].shape == whole[k] for k in fused)  # [E, 2I, H]: every expert
    for key, value in one["auto_fp32"].items():
        torch.testing.assert_close(one["auto_state"][key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
