"""The DeepSpeed modules scripts import at top level (`deepspeed.moe`, `deepspeed.compression`), what
in them works (DeepSpeed's expert-parameter test and optimizer-group split, the module-surgery
helpers), `deepspeed.runtime.utils.
set_random_seed`, and `lightspeed.utils` (deepspeed.utils under lightspeed's name). Imported by their
lightspeed names; nothing here registers `deepspeed`."""

import importlib
import random
import sys

import numpy
import pytest
import torch
import transformers

from lightspeed.compat.deepspeed.compression import helper
from lightspeed.compat.deepspeed.moe import utils as moe_utils
from lightspeed.compat.deepspeed.runtime.utils import set_random_seed


def test_is_moe_param_is_deepspeeds_allreduce_test():
    plain = torch.nn.Parameter(torch.ones(2))
    expert = torch.nn.Parameter(torch.ones(2))
    expert.allreduce = False  # how DeepSpeed's MoE layer marks its experts' parameters
    reduced = torch.nn.Parameter(torch.ones(2))
    reduced.allreduce = True
    assert not moe_utils.is_moe_param(plain) and moe_utils.is_moe_param(expert)
    assert not moe_utils.is_moe_param(reduced)
    assert moe_utils.split_params_into_shared_and_expert_params([plain, expert, reduced]) == ([plain, reduced],
                                                                                              [expert])
    assert moe_utils.has_moe_layers(torch.nn.Sequential(torch.nn.Linear(2, 2))) == (False, 0)
    from lightspeed.compat.deepspeed.moe.layer import MoE

    assert moe_utils.has_moe_layers(torch.nn.Sequential(MoE(4, torch.nn.Linear(4, 4), num_experts=3))) == (True, 3)


def test_group_split_without_experts_returns_the_groups():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    group = {"params": iter(params), "name": "dense", "weight_decay": 0.1}
    assert moe_utils.split_params_into_different_moe_groups_for_optimizer(group) == [
        {"params": params, "name": "dense", "weight_decay": 0.1}]
    groups = ({"params": params[:2], "name": "a"}, {"params": params[2:], "name": "b"})
    assert moe_utils.split_params_into_different_moe_groups_for_optimizer(groups) == list(groups)
    assert moe_utils.configure_moe_param_groups(params) == [{"params": params, "name": "dense-params"}]
    with pytest.raises(ValueError, match="Unknown param group type"):
        moe_utils.split_params_into_different_moe_groups_for_optimizer(params[0])
    torch.optim.AdamW(moe_utils.configure_moe_param_groups(params))  # a torch optimizer takes them


def test_group_split_moves_experts_into_moe_groups():
    """DeepSpeed's layout: the dense parameters stay, each group's experts follow in a copy of its
    settings named after the expert group, cut at max_group_size elements."""
    dense, big, small = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3)), \
        torch.nn.Parameter(torch.ones(2))
    for p in (big, small):
        p.allreduce, p.group_name = False, "ep_size_2"
    groups = moe_utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": [dense, big, small], "name": "main", "lr": 0.5}, max_group_size=4)
    assert groups == [{"params": [dense], "name": "main", "lr": 0.5},
                      {"params": [big], "name": "ep_size_2", "moe": True, "lr": 0.5},
                      {"params": [small], "name": "ep_size_2", "moe": True, "lr": 0.5}]
    assert moe_utils.configure_moe_param_groups([dense, big]) == [
        {"params": [dense], "name": "dense-params"}, {"params": [big], "name": "ep_size_2", "moe": True}]
    with pytest.raises(KeyError, match="needs a 'name'"):
        moe_utils.split_params_into_different_moe_groups_for_optimizer({"params": [big]})


def test_module_surgery_helpers():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                                                 n_positions=8))
    assert helper.recursive_getattr(model, "transformer.h.0.mlp.c_fc") is model.transformer.h[0].mlp.c_fc
    ids = torch.tensor([[1, 2, 3, 4]])
    model.eval()
    with torch.no_grad():
        before = model(ids).logits
        helper.convert_conv1d_to_linear(model, transformers.pytorch_utils.Conv1D)
        after = model(ids).logits
    fc = model.transformer.h[0].mlp.c_fc
    assert type(fc) is torch.nn.Linear and fc.weight.shape == (64, 16)
    assert not any(isinstance(m, transformers.pytorch_utils.Conv1D) for m in model.modules())
    torch.testing.assert_close(after, before)
    replacement = torch.nn.Identity()
    helper.recursive_setattr(model, "transformer.h.0.mlp", replacement)
    assert model.transformer.h[0].mlp is replacement


def test_set_random_seed_seeds_python_numpy_and_torch():
    def draw():
        return random.random(), float(numpy.random.rand()), float(torch.rand(1))

    set_random_seed(1234)
    first = draw()
    set_random_seed(1234)
    assert draw() == first
    set_random_seed(1235)
    assert all(a != b for a, b in zip(draw(), first))


def test_lightspeed_utils_is_deepspeed_utils_under_lightspeeds_name():
    import lightspeed.utils as utils
    from lightspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    compat = importlib.import_module("lightspeed.compat.deepspeed.utils")
    from lightspeed.checkpoint import zero_to_fp32

    assert get_fp32_state_dict_from_zero_checkpoint is zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint
    assert sys.modules["lightspeed.utils.zero_to_fp32"] is compat.zero_to_fp32 is utils.zero_to_fp32
    assert utils.groups is compat.groups and utils.log_dist is compat.log_dist and utils.logger is compat.logger
    assert utils.safe_get_full_fp32_param is compat.safe_get_full_fp32_param  # imported on first use
    assert set(compat.__all__) <= set(utils.__all__) and "log_dist" in dir(utils)
    with pytest.raises(AttributeError, match="module 'lightspeed.utils' has no attribute 'nope'"):
        utils.nope
