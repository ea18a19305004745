"""ZeRO stages 1 and 2 against stage 0 and the single-process reference, on real gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lightspeed
from lightspeed.testing.models import TinyMLP, regression_data
from lightspeed.testing.run_world import run_world
from tests.distributed.test_checkpoint_resume import CONFIG as RESUME_CONFIG
from tests.distributed.test_checkpoint_resume import _resume_worker
from tests.distributed.test_data_parallel import (STEPS, _config, _fp16_overflow_run, engine_losses,
                                                  reference_losses)

pytestmark = pytest.mark.dist

# a small bucket size so every flat buffer has several buckets, each padded to the world size
SMALL_BUCKETS = {"reduce_bucket_size": 50, "allgather_bucket_size": 50}


def _world_cases(with_world2_extras: bool):
    """The plain runs at stages 1 and 2 and, at world 2, the communication volume and accumulation with
    clipping: one spawned world per world size."""
    world = dist.get_world_size()
    out = {}
    if with_world2_extras:  # first: the byte counts of a fresh engine
        out["comm"] = {(stage, overlap): _comm_bytes(stage, overlap) for stage, overlap in ((1, True), (2, False))}
        out["clip"] = {stage: engine_losses(STEPS, _config(2, gas=3, gradient_clipping=0.05, zero_optimization={
            "stage": stage, **SMALL_BUCKETS})) for stage in (1, 2)}
    out["plain"] = {stage: engine_losses(STEPS, _config(world, zero_optimization={"stage": stage, **SMALL_BUCKETS}))
                    for stage in (1, 2)}
    return out


@pytest.fixture(scope="module")
def world_cases():
    return {world: run_world(_world_cases, world, world == 2) for world in (2, 4)}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_stages_match_single_process(stage, world, world_cases):
    ref, ref_state = reference_losses(STEPS)
    for rank in world_cases[world]:
        losses, state, _ = rank["plain"][stage]
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-7)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_accumulation_and_clipping(stage, world_cases):
    ref, ref_state = reference_losses(STEPS, clip=0.05)
    losses, state, norm = world_cases[2][0]["clip"][stage]
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-7)
    assert norm > 0.05
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def _solo_worker():
    cfgs = {stage: _config(1, gas=3, gradient_clipping=0.05, zero_optimization={"stage": stage, **SMALL_BUCKETS})
            for stage in (1, 2, 3)}
    return {"runs": {stage: engine_losses(STEPS, cfg) for stage, cfg in cfgs.items()},
            "memory": {stage: _memory(stage) for stage in (0, 1, 2)}}


def test_one_rank_accumulates_in_the_shard():
    """A data-parallel world of one (stage12.py's Note: one rank; stage 3 adds gradients to its shard
    without a collective): accumulation and clipping give the reference at stages 1-3, and stages 1
    and 2 hold one gradient buffer (bf16, as many bytes as the parameters), no fp32 gradient copy and
    no second whole-size buffer."""
    ref, ref_state = reference_losses(STEPS, clip=0.05)
    out = run_world(_solo_worker, 1)[0]
    for stage, (losses, state, norm) in out["runs"].items():
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-7), stage
        assert norm > 0.05
        for k, v in ref_state.items() if stage < 3 else ():  # stage 3's module holds released placeholders
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    s0 = out["memory"][0]
    for stage in (1, 2):
        assert out["memory"][stage]["grads"] == s0["lp_params"], stage


def _low_precision_stages():
    """bf16 losses and fp16 overflow traces at stages 0, 1 and 2, in one world (fewer start-ups)."""
    bf16 = {"bf16": {"enabled": True}}
    return {stage: (engine_losses(STEPS, _config(2, zero_optimization={"stage": stage}, **bf16))[0],
                    _fp16_overflow_run({2, 3}, stage)) for stage in (0, 1, 2)}


def test_sharded_bf16_and_fp16_overflow_track_stage0():
    """bf16 stages 1-2 track stage 0's bf16 losses; an fp16 overflow on one rank is skipped by every
    rank, with stage 0's loss scale, LR and step trace."""
    ranks = run_world(_low_precision_stages, 2)
    for stage in (1, 2):
        assert ranks[0][stage][0] == pytest.approx(ranks[0][0][0], rel=2e-2, abs=1e-2), stage
        assert ranks[0][stage][1] == ranks[1][stage][1] == ranks[0][0][1], stage


def _memory(stage: int):
    world = dist.get_world_size()
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 61))
    cfg = _config(world, bf16={"enabled": True}, zero_optimization={"stage": stage, "reduce_bucket_size": 5000})
    cfg["train_batch_size"] = 4 * world
    engine, *_ = lightspeed.initialize(model=model, config=cfg)
    x = torch.randn(4, 64).bfloat16()
    engine.backward(engine(x).float().square().mean())
    engine.step()
    return engine.memory_breakdown()["cpu"]


def _memory_stages():
    return [_memory(stage) for stage in (0, 1, 2)]


def test_memory_of_sharded_categories_is_a_quarter_at_world_size_4():
    s0, s1, s2 = run_world(_memory_stages, 4)[1]
    for s in (s1, s2):
        assert s["master_params"] == pytest.approx(s0["master_params"] / 4, rel=0.02)
        assert s["optimizer_state"] == pytest.approx(s0["optimizer_state"] / 4, rel=0.05)
        assert s["lp_params"] == pytest.approx(s0["lp_params"], rel=0.02)
    # stage 1 keeps whole bf16 gradients (as many bytes as the bf16 params) plus its fp32 shard;
    # stage 2 keeps only the shard (stage 0: whole bf16 gradients plus the whole fp32 copy)
    assert s1["grads"] == pytest.approx(s0["lp_params"] + s0["grads"] / 4, rel=0.02)
    assert s2["grads"] == pytest.approx(s0["grads"] / 4, rel=0.02)


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_checkpoint_resume_is_identical(tmp_path, stage):
    cfg = dict(RESUME_CONFIG, zero_optimization={"stage": stage, **SMALL_BUCKETS})
    for first, uninterrupted, resumed in run_world(_resume_worker, 2, str(tmp_path), cfg):
        assert resumed == uninterrupted
    files = sorted(p.name for p in (tmp_path / "global_step4").iterdir())
    assert files == ["checksums_rank0.json", "checksums_rank1.json", "model_states.pt", "optim_states_rank0.pt",
                     "optim_states_rank1.pt", "rng_rank0.pt", "rng_rank1.pt"]


def _gpt_losses(stage: int, steps: int = 6):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from examples.gpt import GPT, GPTConfig

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("demo", n_layer=2, n_embd=32, n_head=2, block_size=16))
    cfg = {"train_batch_size": 8, "steps_per_print": 1000, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 700}}
    engine, *_ = lightspeed.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (steps, 8, 17), generator=g)
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for s in range(steps):
        batch = data[s, rank * micro:(rank + 1) * micro]
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    tied = engine.module.lm_head.weight is engine.module.wte.weight if hasattr(engine.module, "lm_head") else True
    return losses, tied


def test_gpt_with_tied_embeddings_matches_stage0():
    (ref, _), _ = run_world(_gpt_losses, 2, 0)
    for stage in (1, 2):
        (losses, tied), _ = run_world(_gpt_losses, 2, stage)
        assert tied
        assert losses == pytest.approx(ref, rel=1e-5)


def _untested_optimizer():
    cfg = {"train_batch_size": 4, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    try:
        lightspeed.initialize(model=TinyMLP(), config=cfg)
    except ValueError as err:
        msg = str(err)
    else:
        msg = None
    cfg["zero_allow_untested_optimizer"] = True
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=cfg)
    return msg, type(engine.optimizer).__name__


def test_untested_optimizer_needs_the_flag():
    msg, name = run_world(_untested_optimizer, 1)[0]
    assert msg and "zero_allow_untested_optimizer" in msg and "Lamb" in msg
    assert name == "FusedLamb"


def _comm_bytes(stage: int, overlap: bool):
    world = dist.get_world_size()
    model = TinyMLP()
    cfg = _config(world, zero_optimization={"stage": stage, "overlap_comm": overlap, **SMALL_BUCKETS})
    engine, *_ = lightspeed.initialize(model=model, config=cfg)
    x, y = regression_data(8 * world)
    micro = engine.train_micro_batch_size_per_gpu()
    engine.backward(engine(x[:micro], y[:micro]))
    engine.step()
    padded = sum(s.flat.layout.padded_numel for s in engine.strategy.shards)
    return dict(engine.comm.stats.bytes), padded


@pytest.mark.parametrize("stage,overlap", [(1, True), (2, False)])
def test_communication_volume_is_twice_the_parameter_bytes(stage, overlap, world_cases):
    stats, padded = world_cases[2][0]["comm"][(stage, overlap)]
    param_bytes = 4 * padded  # fp32 model, every bucket padded to the world size
    assert stats["reduce_scatter"] == param_bytes and stats["all_gather"] == param_bytes
    assert stats["all_reduce"] == 4  # the squared grad norm (no fp16: no overflow flag)


def _hf_gpt2_stages():
    from tests.distributed.test_stage3 import config, train

    world = dist.get_world_size()
    return {stage: train("hf-gpt2", config(world, stage), 10) for stage in (0, 1, 2)}


def test_hf_gpt2_from_config_matches_stage0_at_stages_1_and_2():
    pytest.importorskip("transformers")
    results = run_world(_hf_gpt2_stages, 2)[0]
    ref_losses = results[0]["losses"]
    for stage in (1, 2):
        assert results[stage]["losses"] == pytest.approx(ref_losses, rel=1e-5)


def _stage3_comm_bytes():
    world = dist.get_world_size()
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0}
    engine, *_ = lightspeed.initialize(model=model, config=_config(world, zero_optimization=zero))
    x = torch.randn(4, 16)
    engine.backward(engine(x).square().mean())  # first step: records the order (no prefetch yet)
    engine.step()
    engine.comm.stats.reset()
    engine.backward(engine(x).square().mean())
    engine.step()
    return dict(engine.comm.stats.bytes)


def test_stage3_communication_volume_is_three_times_the_parameter_bytes():
    stats = run_world(_stage3_comm_bytes, 2)[0]
    padded = 3 * (16 * 16 + 16 + 0)  # three blocks of 272 elements: even, so no padding at world size 2
    param_bytes = 4 * padded
    # gathered once for forward and once for backward, gradients reduce-scattered once
    assert stats["all_gather"] == 2 * param_bytes
    assert stats["reduce_scatter"] == param_bytes


def _grad_buffers(strategy):
    return [strategy._grads] if strategy.stage < 3 else [g.grad_buffers for g in strategy._trainable()]


def _released_or_kept():
    """Stages 1-3 with accumulation, clipping and bf16: each step's forward sees the gradient buffers
    released, and the losses and parameters equal a run that keeps them allocated."""
    from lightspeed.zero.grad_buffers import GradBuffers

    world = dist.get_world_size()
    out = {}
    for stage in (1, 2, 3):
        cfg = _config(world, gas=2, gradient_clipping=0.05, bf16={"enabled": True},
                      zero_optimization={"stage": stage, **SMALL_BUCKETS})
        seen = []
        runs = {}
        for keep in (False, True):
            release = GradBuffers.release
            if keep:  # as before the buffers were released: zeroed in place, `param.grad` views kept
                GradBuffers.release = lambda self: [t.zero_() for t in self._tensors] and None
            try:
                forwards: list[bool] = []  # per forward: were all gradient buffers released?
                orig = lightspeed.initialize

                def initialize(forwards=forwards, orig=orig, **kw):
                    engine, *rest = orig(**kw)
                    buffers = _grad_buffers(engine.strategy)
                    engine.module.register_forward_pre_hook(
                        lambda *_: forwards.append(all(b.released for b in buffers)))
                    return (engine, *rest)

                lightspeed.initialize = initialize  # engine_losses builds its engine through it
                try:
                    runs[keep] = engine_losses(STEPS, cfg)
                finally:
                    lightspeed.initialize = orig
                seen.append(forwards)
            finally:
                GradBuffers.release = release
        out[stage] = (runs[False], runs[True], seen)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_gradient_buffers_are_released_between_steps(world):
    for rank in run_world(_released_or_kept, world):
        for stage, (released, kept, seen) in rank.items():
            assert released[0] == kept[0], stage  # the same losses, bit for bit
            for k, v in kept[1].items():
                assert torch.equal(released[1][k], v), (stage, k)
            # forwards: the first micro-step of every step runs with no gradient memory; the second
            # accumulates into the buffers its first backward brought back
            assert seen[0][0::2] == [True] * STEPS and seen[0][1::2] == [False] * STEPS, stage
            assert not any(seen[1]), stage
