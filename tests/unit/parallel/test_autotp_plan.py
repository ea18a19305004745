"""Tensor-parallel training pieces in one process: a split parameter's slices gather back to the whole
tensor for every style (Conv1D transposed, fused parts, row bias whole), DeepSpeed's tensor_parallel
section turned into a plan (presets, partition_config specs, strict_mode, refused shapes), and the order
of initialize()'s model transforms."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lightspeed.config.errors import ConfigError
from lightspeed.config.tensor_parallel import TensorParallelConfig
from lightspeed.parallel.autotp import config_plan
from lightspeed.parallel.tensor_parallel import TPLayout
from lightspeed.parallel.tp_plan import COLWISE, COLWISE_QKV, ROWWISE, colwise_parts

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("style, role, shape, transposed", [
    (COLWISE, "weight", (8, 6), False),
    (COLWISE, "bias", (8,), False),
    (COLWISE_QKV, "weight", (6, 12), True),  # GPT-2's c_attn: Conv1D [in, out], q|k|v thirds
    (COLWISE_QKV, "bias", (12,), True),
    (colwise_parts(8, 4, 4), "weight", (16, 6), False),
    (ROWWISE, "weight", (6, 8), False),
    (ROWWISE, "weight", (8, 6), True),
    (ROWWISE, "bias", (6,), False),
])
def test_slices_gather_back_to_the_whole_tensor(style, role, shape, transposed):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    layout = TPLayout(style, role, shape, transposed, 2)
    shards = [layout.shard(full, rank) for rank in range(2)]
    assert [layout.shard_shape(rank) for rank in range(2)] == [tuple(s.shape) for s in shards]
    if layout.sharded:
        assert not torch.equal(shards[0], shards[1])
    else:  # a row-parallel bias is whole on every rank
        assert torch.equal(shards[0], full) and torch.equal(shards[1], full)
    assert torch.equal(layout.gather(shards), full)


def test_colwise_qkv_keeps_each_ranks_rows_of_every_third():
    full = torch.arange(12.0).reshape(1, 12)  # Conv1D [in=1, out=12]: q 0-3, k 4-7, v 8-11
    layout = TPLayout(COLWISE_QKV, "weight", (1, 12), True, 2)
    assert layout.shard(full, 1).flatten().tolist() == [2, 3, 6, 7, 10, 11]


def _demo():
    root = str(Path(__file__).resolve().parents[3])
    if root not in sys.path:
        sys.path.insert(0, root)
    from examples.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=4, n_embd=32))


def _section(**values):
    return TensorParallelConfig.model_validate({"autotp_size": 2, **values})


def test_partition_config_specs_make_the_plan():
    specs = {"layer_specs": [
        {"patterns": [r".*\.attn\.c_attn\.weight$"], "partition_type": "column", "shape": [3, -1]},
        {"patterns": [r".*\.c_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.mlp\.c_fc\.weight$"], "partition_type": "column"},
    ]}
    plan = config_plan(_demo(), _section(partition_config=specs))
    assert plan == {"blocks.0.attn.c_attn": colwise_parts(32, 32, 32), "blocks.0.attn.c_proj": ROWWISE,
                    "blocks.0.mlp.c_fc": COLWISE, "blocks.0.mlp.c_proj": ROWWISE}
    with pytest.raises(ConfigError, match="strict_mode: no layer spec matches blocks.0.mlp.c_fc.weight"):
        config_plan(_demo(), _section(partition_config={**specs, "layer_specs": specs["layer_specs"][:2],
                                                        "strict_mode": True}))


def test_refused_spec_keys_are_named():
    bad = {"layer_specs": [{"patterns": [".*c_fc.weight"], "partition_type": "column", "shape": [2, -1, 4]}]}
    with pytest.raises(NotImplementedError, match=r"layer_specs\[\]\.shape=\[2, -1, 4\]"):
        config_plan(_demo(), _section(partition_config=bad))
    gather = {"layer_specs": [{"patterns": [".*c_fc.weight"], "gather_output": True}]}
    with pytest.raises(NotImplementedError, match="gather_output"):
        config_plan(_demo(), _section(partition_config=gather))
    with pytest.raises(NotImplementedError, match="preset_model='chatglm'"):
        config_plan(_demo(), _section(preset_model="chatglm"))


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64))


def test_llama_preset_and_model_plan_agree_and_keep_the_head_whole():
    from_model = config_plan(_llama(), _section())
    assert config_plan(_llama(), _section(preset_model="llama")) == from_model
    assert "lm_head" not in from_model and from_model["model.layers.0.self_attn.o_proj"] == ROWWISE
    skip = {"layer_specs": [{"patterns": [r".*\.mlp\..*"], "partition_type": "skip"}]}
    plan = config_plan(_llama(), _section(partition_config=skip))  # use_default_specs: the rest from the model
    assert not any(".mlp." in name for name in plan) and "model.layers.0.self_attn.q_proj" in plan


def test_layers_that_do_not_divide_are_refused():
    with pytest.raises(ConfigError, match="do not divide by autotp_size=3"):
        config_plan(_demo(), TensorParallelConfig.model_validate({"autotp_size": 3, "partition_config": {
            "layer_specs": [{"patterns": [r".*c_fc\.weight$"], "partition_type": "column"}],
            "use_default_specs": False}}))


def test_initialize_transform_order():
    from lightspeed.runtime.model_transforms import TRANSFORMS

    assert [name for name, _ in TRANSFORMS] == ["tensor_parallel", "sequence_parallel", "autoep", "expert_parallel",
                                              "activation_checkpointing"]


def test_moe_layers_stay_whole():
    """Specs that also match the experts' (and could match the gate's) layers split only the dense ones:
    experts and gates stay whole beside tensor parallelism (DeepSpeed's enable_expert_tensor_parallelism
    False)."""
    from lightspeed.parallel.experts import MoE

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
            expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
            self.moe = MoE(8, expert, num_experts=2)

    specs = {"layer_specs": [{"patterns": [r".*\.0\.weight$", r".*\.wg\.weight$"], "partition_type": "column"},
                             {"patterns": [r".*\.2\.weight$"], "partition_type": "row"}]}
    assert config_plan(Net(), _section(partition_config=specs)) == {"mlp.0": COLWISE, "mlp.2": ROWWISE}
    only_experts = {"layer_specs": [{"patterns": [r"moe\..*"], "partition_type": "column"}]}
    with pytest.raises(ConfigError, match="outside the mixture-of-experts layers"):
        config_plan(Net(), _section(partition_config=only_experts))
