"""AutoEP (`expert_parallel.enabled`) on tiny Hugging Face transformers MoE models, on real gloo
processes at world 2 with autoep_size 2, against the unwrapped model in one process (float32):

- logits: each rank's logits for its own tokens equal the unwrapped model's within 1e-5, for Mixtral,
  Qwen2-MoE (shared expert and its gate), Qwen3-MoE and DeepSeek-V3 (shared experts, sigmoid router
  with group-limited top-k), with the grouped MLP and with DeepSpeed's `use_grouped_mm: false` loop;
  each rank holds only its half of every block's experts, under the model's parameter names, placed
  as global [E, ...] rows over "ep"; a whole-model (every expert) state dict loads into the split model.
- training: 3 AdamW steps through `lightspeed.initialize` at ZeRO 1 and 2 (and Mixtral at 3) match
  one process training the unwrapped model on the same global batch (each step the mean of the two
  ranks' shard losses): the losses within 1e-5 and, below stage 3, the final weights (each rank's
  experts against the reference's rows).
  The models' `output_router_logits` is False by default, so their loss holds no router aux loss;
  one Mixtral case turns it on (the router, kept as the model's, still feeds the aux loss).
- errors: an autoep_size that does not divide the experts, and a model with no MoE block.
"""

from __future__ import annotations

import pytest
import torch

from lightspeed.testing.run_world import run_world

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

SEQ, MICRO, STEPS, LR, VOCAB = 6, 2, 3, 0.01, 64
COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, initializer_range=0.2)
MODELS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
TRAIN = (("mixtral", 1), ("qwen2_moe", 2), ("deepseek_v3", 1), ("qwen3_moe", 2), ("mixtral", 3), ("mixtral_aux", 1))


def build(name: str, experts: int = 4):
    """The tiny model `name`, the same weights on every call."""
    import transformers as tf

    torch.manual_seed(0)
    if name in ("mixtral", "mixtral_aux"):  # mixtral_aux: the router's aux loss added to the loss
        aux = dict(output_router_logits=True, router_aux_loss_coef=0.1) if name == "mixtral_aux" else {}
        model = tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=24, num_local_experts=experts,
                                                       num_experts_per_tok=2, **aux, **COMMON))
    elif name == "qwen2_moe":
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=12,
                                                         shared_expert_intermediate_size=20, num_experts=4,
                                                         num_experts_per_tok=2, decoder_sparse_step=1, **COMMON))
    elif name == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(intermediate_size=24, moe_intermediate_size=12, num_experts=8,
                                                         num_experts_per_tok=2, head_dim=4, norm_topk_prob=True,
                                                         **COMMON))
    else:
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            intermediate_size=24, moe_intermediate_size=12, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, routed_scaling_factor=1.5,
            **{**COMMON, "num_key_value_heads": 4}))
    return model.float()


def data(step: int = 0, world: int = 2):
    gen = torch.Generator().manual_seed(11 + step)
    return torch.randint(0, VOCAB, (world * MICRO, SEQ), generator=gen)


def config(stage: int, **autoep) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage}, "expert_parallel": {"enabled": True, "autoep_size": 2, **autoep}}


def reference_training(name: str):
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for s in range(STEPS):
        ids = data(s)
        shard = [model(input_ids=ids[r * MICRO:(r + 1) * MICRO], labels=ids[r * MICRO:(r + 1) * MICRO]).loss
                 for r in range(2)]
        torch.stack(shard).mean().backward()
        opt.step()
        opt.zero_grad()
        losses.append([float(v.detach()) for v in shard])
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _logits(name: str, rank: int, **autoep):
    import lightspeed
    from lightspeed.parallel.experts.autoep_layer import EPExperts

    engine, *_ = lightspeed.initialize(model=build(name), config=config(0, **autoep))
    ids = data()[rank * MICRO:(rank + 1) * MICRO]
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    if name == "qwen2_moe":  # a whole (every expert) state dict loads into the split model
        other = build(name)
        for p in other.parameters():
            p.data.add_(0.05 * torch.randn_like(p))
        engine.module.load_state_dict(other.state_dict())
        with torch.no_grad():
            reloaded = engine(input_ids=ids).logits
            torch.testing.assert_close(reloaded, other(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(reloaded, logits)
    blocks = [n for n, m in engine.module.named_modules() if isinstance(m, EPExperts)]
    key = f"{blocks[-1]}.gate_up_proj"
    p = engine.placements[key]
    return {"logits": logits, "blocks": blocks, "placement": (key, p.global_shape, p.boxes, p.sharded_over,
                                                            p.reduced_over),
            "local_shape": tuple(engine.module.state_dict()[key].shape)}


def _train(name: str, stage: int, rank: int):
    import lightspeed

    engine, *_ = lightspeed.initialize(model=build(name), config=config(stage))
    losses = []
    for s in range(STEPS):
        ids = data(s)[rank * MICRO:(rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    out = {"losses": losses}
    if stage < 3:  # stage 3's module holds released placeholders
        out["state"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return out


def _error(cfg: dict, experts: int | None):
    import lightspeed

    model = build("mixtral", experts) if experts else torch.nn.Sequential(torch.nn.Linear(4, 4))
    try:
        lightspeed.initialize(model=model, config=cfg)
    except Exception as error:  # noqa: BLE001 - the test reads the type and the message
        return type(error).__name__, str(error)
    return None


def _world():
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {("logits", name): _logits(name, rank) for name in MODELS}
    out[("logits", "mixtral_loop")] = _logits("mixtral", rank, use_grouped_mm=False)
    for name, stage in TRAIN:
        out[("train", name, stage)] = _train(name, stage, rank)
    out["three_experts"] = _error(config(1), 3)
    out["no_moe"] = _error(config(1), None)
    out["routing_key"] = _error(config(1, score_func="sigmoid"), 4)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_world(_world, 2)


@pytest.mark.parametrize("name", MODELS + ("mixtral_loop",))
def test_logits_match_the_unwrapped_model(name, runs):
    model = build(name.replace("_loop", ""))
    model.eval()
    ids = data()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    experts = dict(model.named_parameters())
    for rank, result in enumerate(runs):
        got = result[("logits", name)]
        torch.testing.assert_close(got["logits"], ref[rank * MICRO:(rank + 1) * MICRO], rtol=1e-5, atol=1e-5)
        key, shape, boxes, sharded, reduced = got["placement"]
        full = experts[key].shape
        local = full[0] // 2
        assert shape == tuple(full) and got["local_shape"] == (local,) + tuple(full[1:])
        assert boxes == (((rank * local, (rank + 1) * local),) + tuple((0, n) for n in full[1:]),)
        assert sharded == ("ep",) and reduced == ("dp_replicate", "edp_shard", "sp")
        moe_blocks = [n for n, m in model.named_modules() if n.endswith("mlp") and hasattr(m, "experts")]
        assert got["blocks"] == [f"{n}.experts" for n in moe_blocks]


@pytest.mark.parametrize("name,stage", TRAIN)
def test_training_matches_one_process(name, stage, runs):
    ref_losses, ref_state = reference_training(name)
    for rank, result in enumerate(runs):
        got = result[("train", name, stage)]
        assert got["losses"] == pytest.approx([step[rank] for step in ref_losses], rel=1e-5, abs=1e-6)
        for key, value in got.get("state", {}).items():
            want = ref_state[key]
            if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                local = want.shape[0] // 2
                want = want[rank * local:(rank + 1) * local]
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {key}: {m}")


def test_errors_name_the_key(runs):
    for result in runs:
        kind, message = result["no_moe"]
        assert kind == "ConfigError" and "expert_parallel.enabled" in message
        kind, message = result["three_experts"]
        assert kind == "ConfigError" and "expert_parallel.autoep_size=2 does not divide the 3 experts" in message
        kind, message = result["routing_key"]
        assert kind == "NotImplementedError" and message.startswith("expert_parallel.score_func='sigmoid'")
