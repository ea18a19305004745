"""AutoEP on a tiny GPT-OSS (experts with biases, transposed [E, H, 2I] / [E, I, H] weights, the
clamped interleaved SwiGLU, a router with a bias: the `gpt_oss` preset) on real gloo processes, in one
world of 2 ranks, against the unwrapped model in one process (float32; the expert biases drawn at
random, since the model initialises them to zero, and a SwiGLU limit low enough that the clamp bites):

- logits at autoep_size 2, grouped MLP and DeepSpeed's `use_grouped_mm: false` loop: each rank's
  logits for its own tokens equal the unwrapped model's within 1e-5; each rank holds its half of every
  expert weight and bias, placed as global [E, ...] rows over "ep"; a whole-model (every expert) state
  dict loads into the split model (each rank keeps its rows of the weights and biases).
- training: 3 AdamW steps at autoep_size 2 (ZeRO 1) match one process training the unwrapped model on
  the same global batch (the mean of the two ranks' shard losses): losses within 1e-5, final weights
  and biases (each rank's rows) within 1e-5; at ZeRO 3 the losses.
- checkpoint: the ep2 run saves after 2 steps; an autoep_size 1 engine (ep1 x dp2) loads the tag (the
  expert weights and biases assembled whole from the ranks' rows, with their optimizer state) and goes
  on for 2 steps with the reference's losses (1e-5) and final state.
"""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

SEQ, MICRO, LR, VOCAB, EXPERTS = 6, 2, 0.01, 64, 4
STEPS, SAVED_AFTER = 3, 2  # the ep2 run's steps; the tag is saved after SAVED_AFTER of them
RESUMED = 2  # steps the ep1 engine runs after loading the tag
EXPERT_KEYS = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")


def build():
    """The tiny GPT-OSS, the same weights on every call (its experts run transformers' default grouped_mm
    implementation: intermediate and hidden widths keep its 16-byte strides)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(tf.GptOssConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, num_local_experts=EXPERTS, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, initializer_range=0.2, swiglu_limit=0.5))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(0.0, 0.3)
    return model.float()


def data(step: int):
    gen = torch.Generator().manual_seed(11 + step)
    return torch.randint(0, VOCAB, (2 * MICRO, SEQ), generator=gen)


def config(autoep_size: int = 2, stage: int = 1, **autoep) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage},
            "expert_parallel": {"enabled": True, "autoep_size": autoep_size, **autoep}}


def reference_training(steps: int):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for s in range(steps):
        ids = data(s)
        shard = [model(input_ids=ids[r * MICRO:(r + 1) * MICRO], labels=ids[r * MICRO:(r + 1) * MICRO]).loss
                 for r in range(2)]
        torch.stack(shard).mean().backward()
        opt.step()
        opt.zero_grad()
        losses.append([float(v.detach()) for v in shard])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _logits(rank: int, **autoep):
    import lightspeed

    engine, *_ = lightspeed.initialize(model=build(), config=config(**autoep))
    engine.eval()
    ids = data(0)[rank * MICRO:(rank + 1) * MICRO]
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    other = build()  # every expert's weights and biases moved: the split model takes its rows
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.module.load_state_dict(other.state_dict())
    with torch.no_grad():
        reloaded = (engine(input_ids=ids).logits, other(input_ids=ids).logits)
    placements = {k: (p.global_shape, p.boxes, p.sharded_over) for k, p in engine.placements.items()
                  if k.startswith("model.layers.1.mlp.experts.")}
    shapes = {k: tuple(v.shape) for k, v in engine.module.state_dict().items() if k.startswith("model.layers.1.mlp.")}
    return {"logits": logits, "reloaded": reloaded, "placements": placements, "shapes": shapes}


def _steps(engine, rank: int, steps) -> list[float]:
    losses = []
    for s in steps:
        ids = data(s)[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _state(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _world(tmp: str):
    import torch.distributed as dist

    import lightspeed

    rank = dist.get_rank()
    out = {"logits": _logits(rank), "logits_loop": _logits(rank, use_grouped_mm=False)}
    engine, *_ = lightspeed.initialize(model=build(), config=config())
    losses = _steps(engine, rank, range(SAVED_AFTER))
    engine.save_checkpoint(tmp, tag="ep2")
    losses += _steps(engine, rank, range(SAVED_AFTER, STEPS))
    out["train"] = {"losses": losses, "state": _state(engine)}
    stage3, *_ = lightspeed.initialize(model=build(), config=config(stage=3))
    out["train_stage3"] = _steps(stage3, rank, range(STEPS))
    resumed, *_ = lightspeed.initialize(model=build(), config=config(autoep_size=1))
    resumed.load_checkpoint(tmp, tag="ep2")
    out["resumed"] = {"losses": _steps(resumed, rank, range(SAVED_AFTER, SAVED_AFTER + RESUMED)),
                      "state": _state(resumed)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_world(_world, 2, str(tmp_path_factory.mktemp("autoep_gpt_oss")))


@pytest.mark.parametrize("which", ["logits", "logits_loop"])
def test_logits_match_the_unwrapped_model(which, runs):
    model = build()
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=data(0)).logits
    whole = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for rank, result in enumerate(runs):
        got = result[which]
        torch.testing.assert_close(got["logits"], ref[rank * MICRO:(rank + 1) * MICRO], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(*got["reloaded"], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got["reloaded"][0], got["logits"])
        assert sorted(got["placements"]) == sorted(f"model.layers.1.mlp.{k}" for k in EXPERT_KEYS)
        for key, (shape, boxes, sharded) in got["placements"].items():
            local = EXPERTS // 2
            assert shape == whole[key] and sharded == ("ep",)
            assert boxes == (((rank * local, (rank + 1) * local),) + tuple((0, n) for n in shape[1:]),)
            assert got["shapes"][key] == (local,) + shape[1:]
        # the router (weight and bias) stays the model's, whole
        assert got["shapes"]["model.layers.1.mlp.router.bias"] == (EXPERTS,)


def _rows(key: str, value: torch.Tensor, rank: int, ep: int) -> torch.Tensor:
    if ep > 1 and key.endswith(EXPERT_KEYS):
        local = value.shape[0] // ep
        return value[rank * local:(rank + 1) * local]
    return value


def test_training_matches_one_process(runs):
    ref_losses, ref_state = reference_training(STEPS)
    for rank, result in enumerate(runs):
        got = result["train"]
        assert got["losses"] == pytest.approx([step[rank] for step in ref_losses], rel=1e-5, abs=1e-6)
        assert result["train_stage3"] == pytest.approx([step[rank] for step in ref_losses], rel=1e-5, abs=1e-6)
        assert set(got["state"]) == set(ref_state)
        for key, value in got["state"].items():
            torch.testing.assert_close(value, _rows(key, ref_state[key], rank, 2), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key}: {m}")


def test_ep2_checkpoint_resumes_at_ep1(runs):
    ref_losses, ref_state = reference_training(SAVED_AFTER + RESUMED)
    moved = [k for k in ref_state if k.endswith("experts.down_proj_bias")]
    assert moved and all(not torch.allclose(ref_state[k], build().state_dict()[k]) for k in moved)
    for rank, result in enumerate(runs):
        got = result["resumed"]
        assert got["losses"] == pytest.approx([step[rank] for step in ref_losses[SAVED_AFTER:]], rel=1e-5, abs=1e-6)
        for key, value in got["state"].items():
            torch.testing.assert_close(value, ref_state[key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {key}: {m}")
