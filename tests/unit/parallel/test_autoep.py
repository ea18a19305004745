"""AutoEP in one process: `grouped_mlp` against its loop definition (values and gradients, experts
with no rows, no rows at all), the `expert_parallel` section's keys and defaults (DeepSpeed's
`parse_autoep_config`), detection (by model_type, by preset_model, the pattern overrides, nothing
found), the refused keys, and `initialize()` at autoep_size 1 (every expert local, logits equal to the
unwrapped model's, one training step's loss and gradients as the unwrapped model's)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import lightspeed
from lightspeed.config import load
from lightspeed.config.errors import ConfigError
from lightspeed.config.expert_parallel import ExpertParallelConfig
from lightspeed.parallel.experts.autoep import detect_moe_blocks
from lightspeed.parallel.experts.autoep_layer import EPExperts
from lightspeed.parallel.experts.grouped_mlp import grouped_kernel, grouped_mlp, grouped_mlp_reference


def _weights(experts=3, hidden=5, inter=4):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(experts, 2 * inter, hidden, generator=gen, requires_grad=True),
            torch.randn(experts, hidden, inter, generator=gen, requires_grad=True))


@pytest.mark.parametrize("counts", [[3, 0, 2], [0, 0, 4], [1, 1, 1], [0, 0, 0]])
def test_grouped_mlp_matches_the_loop(counts):
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    results = []
    # the GPU's path through ops/grouped_gemm (here its reference backend): the same layout, read transposed
    through_ops = functools.partial(grouped_kernel, backend="reference")
    for fn in (grouped_mlp, through_ops, grouped_mlp_reference):
        w1, w2 = _weights()
        out = fn(x, counts, w1, w2, F.silu)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), x.grad.clone(), w1.grad, w2.grad))
        x.grad = None
    for other in results[:2]:  # fp32, summed in another order than the loop's: fp32's tolerance
        for got, want in zip(other, results[2]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the definition: expert e's rows through its own gated MLP
    w1, w2 = _weights()
    if int(counts.sum()):
        e = int(torch.nonzero(counts)[0])
        start = int(counts[:e].sum())
        gate, up = (x[start:start + 1] @ w1[e].T).chunk(2, -1)
        torch.testing.assert_close(grouped_mlp(x, counts, w1, w2, F.silu)[start:start + 1],
                                   (F.silu(gate) * up) @ w2[e].T)


def test_grouped_mlp_refuses_mismatched_shapes():
    w1, w2 = _weights()
    with pytest.raises(ValueError, match="number of experts"):
        grouped_mlp(torch.zeros(2, 5), torch.tensor([1, 1]), w1, w2, F.silu)


def test_section_defaults_are_deepspeeds():
    section = ExpertParallelConfig()
    assert (section.enabled, section.autoep_size, section.expert_tensor_parallel_size, section.preset_model,
            section.use_grouped_mm, section.route_scale, section.score_apply, section.combine_impl,
            section.score_func, section.top_k, section.routed_scaling_factor, section.expert_w3_given) == \
        (False, 1, 1, None, True, 1.0, "auto", "auto", "auto", "auto", "auto", False)
    with pytest.raises(ConfigError, match="expert_parallel.score_func"):
        load({"train_batch_size": 1, "expert_parallel": {"score_func": "tanh"}}, world_size=1)
    with pytest.raises(ConfigError, match="expert_parallel.experts_pattern"):
        load({"train_batch_size": 1, "expert_parallel": {"experts_pattern": "experts"}}, world_size=1)


def _tiny(kind="mixtral"):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=16, initializer_range=0.2)
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
                                                      **common))
    return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(intermediate_size=8, moe_intermediate_size=8,
                                                    shared_expert_intermediate_size=8, num_experts=4,
                                                    num_experts_per_tok=2, decoder_sparse_step=1, **common))


def test_detection():
    section = ExpertParallelConfig(enabled=True)
    blocks = detect_moe_blocks(_tiny("qwen2"), section)
    assert [(b.name, b.preset_name, b.num_experts) for b in blocks] == \
        [("model.layers.0.mlp", "qwen3_moe", 4), ("model.layers.1.mlp", "qwen3_moe", 4)]
    only_first = ExpertParallelConfig(enabled=True, preset_model="mixtral", moe_layer_pattern=r"model\.layers\.0\.mlp")
    assert [b.name for b in detect_moe_blocks(_tiny(), only_first)] == ["model.layers.0.mlp"]
    base = _tiny().model  # a bare base model: names without the "model." prefix
    assert [b.name for b in detect_moe_blocks(base, section)] == ["layers.0.mlp", "layers.1.mlp"]
    with pytest.raises(ConfigError, match="expert_parallel.enabled: no MoE block"):
        detect_moe_blocks(_tiny(), ExpertParallelConfig(enabled=True, router_pattern="router"))
    with pytest.raises(ConfigError, match="expert_parallel.has_shared_experts"):
        detect_moe_blocks(_tiny(), ExpertParallelConfig(enabled=True, has_shared_experts=True,
                                                        shared_experts_pattern="shared_expert"))


CFG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.mark.parametrize("extra,error,match", [
    ({"autoep_size": 2}, ConfigError, "expert_parallel.autoep_size=2"),
    ({"preset_model": "gpt"}, ConfigError, "expert_parallel.preset_model='gpt'"),
    ({"top_k": 3}, NotImplementedError, "expert_parallel.top_k=3"),
    ({"expert_tensor_parallel_size": 2}, NotImplementedError, "expert_parallel.expert_tensor_parallel_size=2"),
    ({"load_balance_coeff": 0.001}, NotImplementedError, "expert_parallel.load_balance_coeff"),
])
def test_refusals_name_the_key(extra, error, match):
    config = {**CFG, "expert_parallel": {"enabled": True, **extra}}
    with pytest.raises(error, match=match):
        lightspeed.initialize(model=_tiny(), config=config, dist_init_required=False)


def test_unknown_model_names_enabled():
    with pytest.raises(ConfigError, match="expert_parallel.enabled"):
        lightspeed.initialize(model=torch.nn.Linear(2, 2), config={**CFG, "expert_parallel": {"enabled": True}},
                              dist_init_required=False)


def test_autoep_size_one_is_the_unwrapped_model():
    ref = _tiny("qwen2")
    engine, *_ = lightspeed.initialize(model=_tiny("qwen2"), dist_init_required=False,
                                       config={**CFG, "expert_parallel": {"enabled": True, "autoep_size": 1}})
    swapped = [n for n, m in engine.module.named_modules() if isinstance(m, EPExperts)]
    assert swapped == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert set(engine.module.state_dict()) == set(ref.state_dict())
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(3))
    want = ref(input_ids=ids, labels=ids)
    got = engine(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    want.loss.backward()
    engine.backward(got.loss)
    grads = dict(ref.named_parameters())
    for name, p in engine.module.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
