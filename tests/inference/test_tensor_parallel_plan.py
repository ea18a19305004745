"""The tensor-parallel plan in one process: the config's base_model_tp_plan mapped to module names (with
the base-model prefix), the untied output head added, styles this engine does not implement refused."""
from __future__ import annotations

import pytest
import torch

from lightspeed.inference.tensor_parallel import (
    COLWISE,
    COLWISE_QKV,
    EXPERTS,
    HEAD,
    ROWWISE,
    Slice,
    build_plan,
    colwise_parts,
)

transformers = pytest.importorskip("transformers")

COMMON = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=96)


def test_llama_plan_names_every_split_layer():
    torch.manual_seed(0)
    plan = build_plan(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)), 2)
    layer = "model.layers.0."
    assert plan == {layer + "self_attn.q_proj": COLWISE, layer + "self_attn.k_proj": COLWISE,
                    layer + "self_attn.v_proj": COLWISE, layer + "self_attn.o_proj": ROWWISE,
                    layer + "mlp.gate_proj": COLWISE, layer + "mlp.up_proj": COLWISE,
                    layer + "mlp.down_proj": ROWWISE, "lm_head": HEAD}


def test_moe_experts_are_planned_and_other_styles_refused():
    """Mixtral's experts module ('moe_tp_experts') is planned whole as EXPERTS (split inside every expert);
    an experts module of another layout, and a style not implemented, raise naming the module."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**COMMON, num_local_experts=2))
    plan = build_plan(model, 2)
    assert plan["model.layers.0.mlp.experts"] == EXPERTS and plan["model.layers.0.self_attn.o_proj"] == ROWWISE
    model.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(NotImplementedError, match="experts model.layers.0.mlp.experts: has_bias=True"):
        build_plan(model, 2)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    llama.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "gather"}
    with pytest.raises(NotImplementedError, match="'gather'.*model.layers.0.mlp.down_proj"):
        build_plan(llama, 2)


def test_replicated_styles_keep_modules_whole():
    """Qwen3's per-head q/k norms are 'replicated_with_grad_allreduce': whole on every rank, not refused."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=8))
    plan = build_plan(model, 2)
    assert "model.layers.0.self_attn.q_norm" not in plan and plan["model.layers.0.self_attn.o_proj"] == ROWWISE


def test_gpt2_plan_splits_the_fused_qkv_by_thirds():
    """GPT-2's config has no base_model_tp_plan: the built-in one, with c_attn's fused q|k|v; the same
    from DeepSpeed's injection_policy form; the tied head stays whole."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=96))
    block = "transformer.h.0."
    want = {block + "attn.c_attn": COLWISE_QKV, block + "attn.c_proj": ROWWISE, block + "mlp.c_fc": COLWISE,
            block + "mlp.c_proj": ROWWISE}
    assert build_plan(model, 2) == want
    policy = {transformers.models.gpt2.modeling_gpt2.GPT2Block: ("attn.c_proj", "mlp.c_proj")}
    assert build_plan(model, 4, policy) == want
    with pytest.raises(ValueError, match="config.num_attention_heads=4 does not divide by tp_size=8"):
        build_plan(model, 8)


def test_phi3_plan_splits_its_fused_layers_within_each_part():
    """Phi-3's config plan gathers qkv_proj's and gate_up_proj's outputs on every rank; the built-in plan
    splits them within their parts instead (q | k | v of grouped-query sizes, gate | up), as DeepSpeed's
    AutoTP does. A part that does not divide is refused, naming the parts."""
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**COMMON, pad_token_id=0, eos_token_id=2))
    layer = "model.layers.0."
    assert build_plan(model, 2) == {layer + "self_attn.qkv_proj": colwise_parts(64, 32, 32),
                                    layer + "self_attn.o_proj": ROWWISE, layer + "mlp.gate_up_proj":
                                    colwise_parts(128, 128), layer + "mlp.down_proj": ROWWISE, "lm_head": HEAD}
    rows = [r for r, _ in Slice(colwise_parts(64, 32, 32), 1, 4).indices((128, 64))]
    assert rows == [slice(16, 32), slice(72, 80), slice(104, 112)]  # rank 1 of 4: its rows of q, k and v
    odd = transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**COMMON, "intermediate_size": 90},
                                                               pad_token_id=0, eos_token_id=2))
    with pytest.raises(ValueError, match=r"gate_up_proj .* has parts of \[90, 90\] rows, which do not divide by "
                                         r"tp_size=4"):
        build_plan(odd, 4)


def test_embedding_styles_keep_the_embedding_whole():
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=8, vocab_size=96))
    plan = build_plan(model, 2)
    assert "gpt_neox.embed_in" not in plan and plan["gpt_neox.layers.0.attention.query_key_value"] == COLWISE


def test_a_model_without_a_plan_is_refused():
    torch.manual_seed(0)
    model = transformers.MptForCausalLM(transformers.MptConfig(n_layers=1, d_model=32, n_heads=4, vocab_size=96))
    with pytest.raises(NotImplementedError, match="MptForCausalLM needs a plan"):
        build_plan(model, 2)


def test_multi_query_layers_keep_their_kv_head_whole():
    """Falcon-7B's and StarCoder's fused [q heads | k | v]: each rank keeps its q rows and all of k and v;
    the one k/v head is no reason to refuse a tp_size (it is not split), the query heads still are."""
    falcon = transformers.FalconForCausalLM(transformers.FalconConfig(  # Falcon-7B's layout: 4 heads of 8
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=96))
    style = build_plan(falcon, 2)["transformer.h.0.self_attention.query_key_value"]
    assert style == colwise_parts(32, 8, 8, whole=(1, 2))
    assert Slice(style, 1, 2).indices((48, 32)) == [(slice(16, 32), slice(None)), (slice(32, 40), slice(None)),
                                                     (slice(40, 48), slice(None))]
    with pytest.raises(ValueError, match="num_attention_heads=4 does not divide by tp_size=8"):
        build_plan(falcon, 8)
