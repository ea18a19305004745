"""ZeRO-3 building blocks without processes: ownership, param groups (gather / release / storage),
reduce scaling, persistence, optimizer binding and refusal, Init and the initialization rule."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from lightspeed.comm.collectives import Communicator
from lightspeed.config.errors import ConfigError
from lightspeed.ops.lamb import FusedLamb as Lamb
from lightspeed.precision.policy import PrecisionPolicy
from lightspeed.testing.models import TinyMLP
from lightspeed.zero import GatheredParameters, Init
from lightspeed.zero.stage3 import Stage3Options, Stage3Strategy, initialize_module_weights, param_state
from lightspeed.zero.stage3.init import owned_params
from lightspeed.zero.reduce import ReduceOptions, mean_scaling, sp_summed
from lightspeed.zero.stage3.param_group import GATHERED, RELEASED, ParamGroup
from lightspeed.zero.stage3.units import choose_units
from lightspeed.zero.stage3.zero_param import ZeroParameter, ZeroParamStatus

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.gpt import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.timeout(30)
TINY_GPT = GPTConfig.preset("demo", n_layer=1, n_embd=16, n_head=2, block_size=8)


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    # zero.Init partitions onto the training device (cuda:<local_rank> where there is one); these
    # tests compare with CPU-built models, whose initial values come from the CPU generator
    monkeypatch.setenv("LIGHTSPEED_ACCELERATOR", "cpu")


def comm1():
    return Communicator(None, world_size=1)


def test_owned_params_give_a_tied_parameter_to_its_first_module():
    model = GPT(TINY_GPT)
    plan = {name: [n for n, _ in own] for _, name, _, own in owned_params(model)}
    assert plan["wte"] == ["wte.weight"] and "lm_head" not in plan
    assert sum(len(v) for v in plan.values()) == len(list(model.parameters()))
    plan = {name: [n for n, _ in own] for _, name, _, own in owned_params(TinyMLP())}
    assert plan[""] == ["tiny", "frozen"]


@pytest.mark.parametrize("prescale,predivide,world,expected", [
    (False, 1.0, 4, (1.0, 0.25)), (True, 1.0, 4, (0.25, 1.0)), (False, 2.0, 4, (0.5, 0.5)),
    (False, 4.0, 4, (0.25, 1.0)), (True, 1.0, 1, (1.0, 1.0))])
def test_mean_scaling_averages_over_ranks(prescale, predivide, world, expected):
    pre, post = mean_scaling(prescale, predivide, world)
    assert (pre, post) == expected and pre * post * world == pytest.approx(1.0)


@pytest.mark.parametrize("stage,sp,world,prescale,predivide,expected", [
    (0, 2, 4, False, 1.0, (1.0, 0.5)), (1, 2, 4, True, 1.0, (0.5, 1.0)), (2, 2, 4, False, 4.0, (0.25, 2.0)),
    (2, 2, 2, False, 1.0, (1.0, 1.0)), (3, 2, 4, False, 1.0, (1.0, 0.25)), (2, 1, 4, False, 1.0, (1.0, 0.25))])
def test_sequence_parallel_ranks_are_summed_at_stages_0_to_2(stage, sp, world, prescale, predivide, expected):
    """DeepSpeed 0.19.8: world / sp at ZeRO 0-2 (predivide, then predivide / (world / sp)), world at 3."""
    reduce = ReduceOptions(sp_summed=sp_summed(stage, sp), prescale_gradients=prescale,
                           gradient_predivide_factor=predivide)
    assert reduce.scaling(world) == expected
    assert reduce.mean_ranks(world) == (world // sp if stage < 3 else world)
    assert dataclasses.replace(reduce, average=False).scaling(world) == (1.0, 1.0)  # "sum" stays a sum
    with pytest.raises(ValueError, match="sequence_parallel_size=2 does not divide the reduce group of 3 ranks"):
        ReduceOptions(sp_summed=2).scaling(3)


def test_group_gathers_into_views_and_frees_the_storage_on_release():
    lin = torch.nn.Linear(3, 2)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    g = ParamGroup("lin", [lin.weight, lin.bias], ["weight", "bias"], [w, b], comm1(), dtype=torch.bfloat16,
                   device=torch.device("cpu"), grad_dtype=torch.bfloat16, keep_master=True)
    assert g.state == RELEASED and lin.weight.numel() == 0 and g.full_flat.untyped_storage().nbytes() == 0
    assert g.lp_shard.dtype == torch.bfloat16 and g.master_shard.dtype == torch.float32
    assert g.master_grad_shard is not g.grad_shard  # bf16 grads, fp32 copy for the optimizer
    assert param_state(lin.weight).group is g and param_state(lin.bias).range.start == 6
    g.gather()
    g.wait()
    assert g.state == GATHERED and torch.equal(lin.weight, w.bfloat16()) and lin.bias.shape == (2,)
    assert lin.weight.data_ptr() == g.full_flat.data_ptr()
    g.release()
    assert lin.weight.numel() == 0 and g.full_flat.untyped_storage().nbytes() == 0
    assert param_state(torch.nn.Parameter(torch.zeros(1))) is None


def _strategy(model, optimizer=None, policy=PrecisionPolicy(), **options):
    options.setdefault("one_rank_views", False)  # the gather machinery, as at more ranks
    return Stage3Strategy(model, optimizer, policy, comm1(), Stage3Options(**options), device=torch.device("cpu"))


def test_persistence_thresholds_follow_deepspeed():
    def persistent(**thresholds):
        model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.Linear(4, 1), torch.nn.LayerNorm(37),
                                    torch.nn.Linear(37, 5))  # one unit each: 3, 5, 74, 190 elements
        return {g.name for g in _strategy(model, **thresholds).groups if g.persistent}

    # groups of at most param_persistence_threshold elements, in unit order, while the total stays
    # within model_persistence_threshold: 0 (3), 1 (5), then 2 (74) only if 82 fit
    assert persistent(param_persistence_threshold=74, model_persistence_threshold=80) == {"0", "1"}
    assert persistent(param_persistence_threshold=74, model_persistence_threshold=82) == {"0", "1", "2"}
    assert persistent(param_persistence_threshold=0) == set()


def test_optimizer_groups_are_contiguous_flat_pieces():
    model = TinyMLP()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight") and p.requires_grad]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    s = _strategy(model, opt)
    assert [g.name for g in s.groups] == ["<root>", "<root> (frozen)"]  # no ModuleList: one unit
    root = s.groups[0]
    # by optimizer group (stable): the decayed weights, then the rest, each in module order
    assert [st.name for st in root.states] == ["fc1.weight", "norm.weight", "fc2.weight", "tiny", "fc1.bias",
                                               "norm.bias", "fc2.bias"]
    assert [t.numel() for t in opt.param_groups[0]["params"]] == [13 * 37 + 37 + 37 * 5]  # one piece per group
    assert [t.numel() for t in opt.param_groups[1]["params"]] == [3 + 37 + 37 + 5]
    assert all(t.dtype == torch.float32 for g in opt.param_groups for t in g["params"])


def test_untested_optimizer_is_refused_unless_allowed():
    model = TinyMLP()
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
        _strategy(model, Lamb(model.parameters()))
    _strategy(TinyMLP(), Lamb(TinyMLP().parameters()), allow_untested_optimizer=True)


def test_init_partitions_parameters_and_keeps_buffers():
    with Init(seed=3):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    assert all(type(p) is ZeroParameter and p.numel() == 0 for p in model.parameters())
    w = model[0].weight
    assert w.ds_shape == (8, 4) and w.ds_numel == 32 and w.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert w.ds_tensor.numel() == 32  # one process: this rank holds every element
    with GatheredParameters(w):
        assert w.shape == (8, 4) and w.ds_status == ZeroParamStatus.AVAILABLE
        assert torch.equal(w, initialize_module_weights(torch.nn.Linear(4, 8), 3 + 1).weight)
    assert w.numel() == 0
    assert not hasattr(torch.nn.Parameter(torch.ones(1)), "ds_numel")
    assert not model[1].running_var.is_meta and torch.equal(model[1].running_var, torch.ones(8))
    with pytest.raises(NotImplementedError, match="NVMe at construction"):
        Init(remote_device="nvme")
    with Init(remote_device="cpu", seed=3):  # shards in host memory (here the device is the host too)
        offloaded = torch.nn.Linear(4, 8)
    st = param_state(offloaded.weight)
    assert st.group.offload.offloads_params and st.group.master_shard is None
    with GatheredParameters(offloaded.weight):
        assert torch.equal(offloaded.weight, initialize_module_weights(torch.nn.Linear(4, 8), 3).weight)
    with Init(enabled=False, remote_device="cpu"):  # not partitioning: nothing to place
        assert not torch.nn.Linear(2, 2).weight.is_meta
    with Init(enabled=False):
        assert not torch.nn.Linear(2, 2).weight.is_meta


def test_materialized_init_model_equals_the_rule_applied_to_a_normal_model():
    with Init(seed=11):
        deferred = GPT(TINY_GPT)
    s = _strategy(deferred)
    largest_unit = max(sum(p.numel() for _, p in u.owned()) for u in choose_units(GPT(TINY_GPT)))
    assert s.setup_peak_numel <= 2 * largest_unit  # one unit's params and its flat buffer at a time
    normal = initialize_module_weights(GPT(TINY_GPT), 11)
    state = s.module_state_dict()
    for k, v in normal.state_dict().items():
        assert torch.equal(state[k], v), k
    assert state["lm_head.weight"] is state["wte.weight"]  # tied: one tensor under both names
    # the rule depends on the seed only, not on the global RNG or on earlier init code
    torch.manual_seed(0)
    again = initialize_module_weights(GPT(TINY_GPT), 11)
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), normal.parameters()))
    assert not torch.equal(initialize_module_weights(GPT(TINY_GPT), 12).wte.weight, normal.wte.weight)


def test_materialize_changes_only_the_modules_own_parameters():
    attn = torch.nn.MultiheadAttention(8, 2)  # its reset_parameters also zeroes out_proj.bias (a child's)
    initialize_module_weights(attn, 5)
    ref = torch.nn.Linear(8, 8)
    initialize_module_weights(ref, 5 + 1)  # out_proj is module 1 of the attention
    assert torch.equal(attn.out_proj.bias, ref.bias) and bool(attn.out_proj.bias.abs().sum() > 0)


def test_gathered_parameters_modify_writes_lp_and_master_shards():
    model = TinyMLP()
    s = _strategy(model, torch.optim.SGD(model.parameters(), lr=0.1), param_persistence_threshold=0,
                  policy=PrecisionPolicy(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32))
    with GatheredParameters(model.fc2.bias, modifier_rank=0) as bias:
        with torch.no_grad():
            bias.copy_(torch.arange(5.0))
    assert model.fc2.bias.numel() == 0
    g = param_state(model.fc2.bias).group
    r = param_state(model.fc2.bias).range
    assert torch.equal(g.master_shard[r.start:r.end], torch.arange(5.0))
    assert torch.equal(s.module_state_dict()["fc2.bias"].float(), torch.arange(5.0))
    with GatheredParameters([model.fc2.bias, model.fc1.weight]) as (b, w):
        assert b.shape == (5,) and w.shape == (37, 13)


class _Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))


def test_set_z3_leaf_modules_makes_units_from_code():
    from lightspeed.zero.stage3.units import (get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules,
                                              z3_leaf_module)

    model = torch.nn.Sequential(_Experts(), torch.nn.Linear(4, 4))
    assert [u.name for u in choose_units(model)] == ["<root>", "0", "0.experts.0", "0.experts.1", "0.experts.2", "1"]
    assert set_z3_leaf_modules(model, ["_Experts"]) == [model[0]]
    assert z3_leaf_module(model[0]) and get_z3_leaf_modules(model) == [model[0]]
    assert [u.name for u in choose_units(model)] == ["<root>", "0", "1"]  # the experts are gathered as one
    assert unset_z3_leaf_modules(model, [_Experts]) == [model[0]] and not z3_leaf_module(model[0])
    assert len(choose_units(model)) == 6
    with pytest.raises(ValueError, match="no module"):
        set_z3_leaf_modules(model, [torch.nn.Conv1d])
    assert set_z3_leaf_modules(model, [torch.nn.Conv1d], raise_if_not_found=False) == []
    # a fully qualified class name, and DeepSpeed's order (children before their parent)
    assert set_z3_leaf_modules(model, [f"{_Experts.__module__}.{_Experts.__qualname__}"]) == [model[0]]
    assert set_z3_leaf_modules(torch.nn.Sequential(model), [torch.nn.Sequential])[0] is model
    unset_z3_leaf_modules(model, [_Experts, torch.nn.Sequential])


def test_configured_leaf_modules_are_marked_when_the_strategy_is_built():
    from lightspeed.zero.stage3.units import LeafRule, z3_leaf_module

    model = torch.nn.Sequential(_Experts(), torch.nn.Linear(4, 4))
    Stage3Strategy(model, None, PrecisionPolicy(), Communicator(None, world_size=1),
                   Stage3Options(one_rank_views=False, leaf_rule=LeafRule(name_suffixes=("experts",))),
                   device=torch.device("cpu"))
    assert z3_leaf_module(model[0].experts) and not z3_leaf_module(model[0])  # DeepSpeed flags them at initialize


def test_init_signature_dtype_config_module_and_nesting():
    with Init(dtype=torch.bfloat16, seed=1):
        a = torch.nn.Linear(4, 4)
    with Init(config_dict_or_path={"bf16": {"enabled": True}}, seed=1):
        b = torch.nn.Linear(4, 4)
    for layer in (a, b):
        assert param_state(layer.weight).group.lp_shard.dtype == torch.bfloat16 and layer.weight.dtype == torch.bfloat16
    with Init(config_dict_or_path={"zero_optimization": {"offload_param": {"device": "cpu"}}}):
        placed = torch.nn.Linear(4, 4)
    assert param_state(placed.weight).group.offload.param == "cpu"
    with pytest.raises(NotImplementedError, match="NVMe"):
        Init(config_dict_or_path={"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/x"}}})
    with pytest.raises(NotImplementedError, match="hpZ"):
        Init(zero_param_parallel_group=object())
    built = torch.nn.Linear(3, 2)
    value = built.weight.detach().clone()
    Init(module=built)  # an already built model is partitioned at once
    assert built.weight.numel() == 0 and built.weight.ds_shape == (2, 3)
    with GatheredParameters(built.weight):
        assert torch.equal(built.weight, value)
    with Init(seed=2):  # nested blocks partition once, when the outermost ends
        with Init(seed=3):
            inner = torch.nn.Linear(2, 2)
        assert inner.weight.is_meta
    assert inner.weight.numel() == 0 and param_state(inner.weight) is not None


def test_init_model_is_taken_over_by_the_strategy_with_pending_external_parameters():
    from lightspeed.zero import register_external_parameter
    from lightspeed.zero.stage3.init import StandaloneScheduler

    with Init(seed=4):
        model = GPT(TINY_GPT)
        register_external_parameter(model.blocks[0], model.wte.weight)  # before any strategy exists
    ds_id = model.wte.weight.ds_id
    assert isinstance(param_state(model.wte.weight).group.coordinator, StandaloneScheduler)
    s = _strategy(model)
    st = param_state(model.wte.weight)
    assert st.group in s.groups and model.wte.weight.ds_id == ds_id  # same id after the take-over
    assert st.group in s.coordinator.uses[id(model.blocks[0])]


def test_init_starts_torch_distributed_under_a_launchers_environment():
    """As DeepSpeed's: a one-process launcher environment (RANK / WORLD_SIZE set) is enough."""
    import os
    import subprocess

    from lightspeed.comm.init import free_port

    code = ("import torch.distributed as d\nfrom lightspeed.zero import Init\nassert not d.is_initialized()\n"
            "Init()\nassert d.is_initialized() and d.get_world_size() == 1\n")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
