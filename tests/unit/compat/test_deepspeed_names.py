"""Names DeepSpeed's own unit tests import, with DeepSpeed's values and behaviour: the optimizer and LR
schedule constants, the precision and ZeRO config models (`runtime.precision_config`,
`runtime.zero.config`, `runtime.zero.offload_config`, `DeepSpeedConfig.zero_config` under DeepSpeed's
field names), leaf modules by name and suffix, `safe_update_full_grad_vectorized`,
`unwrap_model_for_generation` and the checkpoint file names. The compat modules are imported by their
lightspeed names, except in the one test that registers lightspeed as `deepspeed` (in a subprocess)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lightspeed
from lightspeed.compat.deepspeed.checkpoint import utils as ckpt_utils
from lightspeed.compat.deepspeed.runtime import config as ds_config
from lightspeed.compat.deepspeed.runtime import lr_schedules
from lightspeed.compat.deepspeed.runtime import precision_config as pc
from lightspeed.compat.deepspeed.runtime.zero import config as zc
from lightspeed.compat.deepspeed.runtime.zero import offload_config as oc
from lightspeed.compat.deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
from lightspeed.compat.deepspeed import utils as ds_utils
from lightspeed.zero.stage3 import options as stage3_options
from lightspeed.zero.stage3.units import LeafRule, choose_units, get_z3_leaf_modules

pytestmark = pytest.mark.timeout(120)


def test_optimizer_constants_are_deepspeeds():
    expected = {"ADAGRAD_OPTIMIZER": "adagrad", "ADAM_OPTIMIZER": "adam", "ADAMW_OPTIMIZER": "adamw",
                "LAMB_OPTIMIZER": "lamb", "ONEBIT_ADAM_OPTIMIZER": "onebitadam",
                "ZERO_ONE_ADAM_OPTIMIZER": "zerooneadam", "ONEBIT_LAMB_OPTIMIZER": "onebitlamb",
                "MUADAM_OPTIMIZER": "muadam", "MUADAMW_OPTIMIZER": "muadamw", "MUSGD_OPTIMIZER": "musgd",
                "LION_OPTIMIZER": "lion", "MUON_OPTIMIZER": "muon"}
    assert {k: getattr(ds_config, k) for k in expected} == expected
    assert sorted(ds_config.DEEPSPEED_OPTIMIZERS) == sorted(expected.values())
    assert (ds_config.TORCH_ADAM_PARAM, ds_config.ADAM_W_MODE, ds_config.ADAM_W_MODE_DEFAULT) == (
        "torch_adam", "adam_w_mode", True)
    from lightspeed.compat.deepspeed.runtime import engine

    assert engine.ONEBIT_ADAM_OPTIMIZER == "onebitadam" and engine.LION_OPTIMIZER == "lion"


def test_lr_schedule_constants_are_deepspeeds():
    keys = {"LR_SCHEDULE": "lr_schedule", "LR_RANGE_TEST_MIN_LR": "lr_range_test_min_lr",
            "LR_RANGE_TEST_STEP_RATE": "lr_range_test_step_rate", "LR_RANGE_TEST_STEP_SIZE": "lr_range_test_step_size",
            "LR_RANGE_TEST_STAIRCASE": "lr_range_test_staircase", "EDGE_VALUE": "edge_value",
            "MID_VALUE": "mid_value", "CYCLE_FIRST_STEP_SIZE": "cycle_first_step_size",
            "CYCLE_FIRST_STAIR_COUNT": "cycle_first_stair_count", "CYCLE_SECOND_STEP_SIZE": "cycle_second_step_size",
            "CYCLE_SECOND_STAIR_COUNT": "cycle_second_stair_count", "DECAY_STEP_SIZE": "decay_step_size",
            "CYCLE_MIN_LR": "cycle_min_lr", "CYCLE_MAX_LR": "cycle_max_lr", "DECAY_LR_RATE": "decay_lr_rate",
            "CYCLE_MIN_MOM": "cycle_min_mom", "CYCLE_MAX_MOM": "cycle_max_mom", "DECAY_MOM_RATE": "decay_mom_rate",
            "WARMUP_MIN_LR": "warmup_min_lr", "WARMUP_MAX_LR": "warmup_max_lr", "WARMUP_NUM_STEPS": "warmup_num_steps",
            "WARMUP_TYPE": "warmup_type", "WARMUP_LOG_RATE": "log", "WARMUP_LINEAR_RATE": "linear",
            "WARMUP_MIN_RATIO": "warmup_min_ratio", "COS_MIN_RATIO": "cos_min_ratio",
            "TOTAL_NUM_STEPS": "total_num_steps"}
    assert {k: getattr(lr_schedules, k) for k in keys} == keys
    assert lr_schedules.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
                                               "WarmupCosineLR"]
    # the key names are the schedules' parameter names: a config written with them builds the schedule
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = lr_schedules.OneCycle(opt, **{keys["CYCLE_MIN_LR"]: 0.01, keys["CYCLE_MAX_LR"]: 0.1,
                                         keys["CYCLE_FIRST_STEP_SIZE"]: 4})
    assert sched.get_lr()[0] == pytest.approx(0.01)


def test_precision_config_models():
    fp16 = pc.get_float16_config({"fp16": {"enabled": True, "loss_scale_window": 500, "initial_scale_power": 8}})
    assert isinstance(fp16, pc.DeepSpeedFP16Config) and fp16.enabled and fp16.loss_scale == 0
    assert fp16.dynamic_loss_scale_args() == {"init_scale": 256, "scale_window": 500, "delayed_shift": 2,
                                              "consecutive_hysteresis": False, "min_scale": 1}
    assert pc.get_float16_config({}).enabled is False
    assert pc.get_bfloat16_config({"bf16": {"enabled": True}}).enabled
    old = pc.get_bfloat16_config({"bfloat16": {"enabled": True, "immediate_grad_update": True}})
    assert isinstance(old, pc.DeepSpeedBF16Config) and old.enabled and old.immediate_grad_update
    assert pc.get_bfloat16_config({}).check_grad_overflow is True  # DeepSpeed's default
    with pytest.raises(ValueError, match="unsupported"):
        pc.DeepSpeedBF16Config(unsupported=True)
    with pytest.raises(ValueError, match="loss_scale"):
        pc.DeepSpeedFP16Config(loss_scale=-1)


def test_zero_config_model_under_deepspeeds_names():
    z = zc.DeepSpeedZeroConfig(**{"stage3_prefetch_bucket_size": 12345, "stage3_param_persistence_threshold": 7,
                                  "stage3_max_reuse_distance": 9, "stage3_max_live_parameters": 11,
                                  "stage3_gather_16bit_weights_on_model_save": True})
    assert (z.prefetch_bucket_size, z.param_persistence_threshold, z.max_reuse_distance, z.max_live_parameters,
            z.gather_16bit_weights_on_model_save) == (12345, 7, 9, 11, True)
    assert zc.DeepSpeedZeroConfig(prefetch_bucket_size=5).stage3_prefetch_bucket_size == 5  # the field name
    assert zc.DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    assert isinstance(zc.DeepSpeedZeroConfig(cpu_offload_param=True).offload_param, oc.DeepSpeedZeroOffloadParamConfig)
    off = zc.DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer
    assert isinstance(off, oc.DeepSpeedZeroOffloadOptimizerConfig) and off.device == oc.OffloadDeviceEnum.cpu
    assert [zc.DeepSpeedZeroConfig(stage=s).overlap_comm for s in range(4)] == [False, False, False, True]
    assert zc.DeepSpeedZeroConfig(stage=3).stage == zc.ZeroStageEnum.weights
    assert zc.DeepSpeedZeroConfig().offload_param is None and zc.DeepSpeedZeroConfig().offload_optimizer is None
    both = zc.DeepSpeedZeroConfig(offload_param={}, offload_optimizer={})
    assert isinstance(both.offload_param, oc.DeepSpeedZeroOffloadParamConfig)
    assert isinstance(both.offload_optimizer, oc.DeepSpeedZeroOffloadOptimizerConfig)
    assert oc.DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline
    assert oc.OffloadDeviceEnum("nvme") == "nvme" and oc.OffloadStateTypeEnum.lp_grads == "lp_grads"
    with pytest.raises(ValueError, match="must be 0, 1, 2 or 3"):
        zc.DeepSpeedZeroConfig(stage=4)
    with pytest.raises(ValueError, match="both are given"):
        zc.DeepSpeedZeroConfig(prefetch_bucket_size=1, stage3_prefetch_bucket_size=2)


def test_leaf_module_config_under_deepspeeds_names():
    from lightspeed.compat.deepspeed.runtime.zero import leaf_module_config as lc

    # DeepSpeed 0.18's defaults: Hugging Face's sparse MoE blocks are leaves unless the config says otherwise
    assert zc.DeepSpeedZeroConfig().leaf_module.classes == lc.DEFAULT_LEAF_MODULE_CLASSES
    assert len(lc.DEFAULT_LEAF_MODULE_CLASSES) == 3 and all(c.startswith("transformers.models.")
                                                            for c in lc.DEFAULT_LEAF_MODULE_CLASSES)
    assert lc.DEFAULT_LEAF_MODULE_NAMES == [] and lc.DEFAULT_LEAF_MODULE_NAME_SUFFIXES == []
    leaf = zc.DeepSpeedZeroConfig(leaf_module={"classes": "my.Class", "names": ["a", "b", "a"],
                                               "name_suffixes": "tail"}).leaf_module
    assert (leaf.classes, leaf.names, leaf.name_suffixes) == (["my.Class"], ["a", "b"], ["tail"])
    assert isinstance(leaf, lc.DeepSpeedZeroLeafModuleConfig)


def test_deepspeed_config_exposes_the_models():
    cfg = ds_config.DeepSpeedConfig({
        "train_batch_size": 2, "fp16": {"enabled": True, "initial_scale_power": 4},
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 99, "param_persistence_threshold": 5,
                              "offload_param": {"device": "cpu"}}})
    z = cfg.zero_config
    assert isinstance(z, zc.DeepSpeedZeroConfig) and z.stage == 3
    assert (z.max_live_parameters, z.param_persistence_threshold, z.prefetch_bucket_size) == (99, 5, 50_000_000)
    assert z.offload_param.device == oc.OffloadDeviceEnum.cpu and z.overlap_comm is True
    assert isinstance(cfg.float16_config, pc.DeepSpeedFP16Config) and cfg.float16_config.initial_dynamic_scale() == 16
    assert isinstance(cfg.bfloat16_config, pc.DeepSpeedBF16Config) and not cfg.bfloat16_config.enabled
    assert cfg.gradient_allreduce_op == "mean"
    with pytest.raises(AttributeError):
        cfg.gradient_allreduce_op = "sum"  # read-only: the config decides


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(4, 4)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])


def test_leaf_modules_by_name_and_suffix():
    net = Net()
    assert "layers.0.mlp.0" in {u.name for u in choose_units(net, LeafRule())}  # a Sequential's child: a unit
    found, missing = ds_utils.set_z3_leaf_modules_by_name(net, ["layers.0.mlp", "nope"], raise_if_not_found=False)
    assert found == [net.layers[0].mlp] and missing == ["nope"]
    assert get_z3_leaf_modules(net) == [net.layers[0].mlp]
    with pytest.raises(ValueError, match="nope"):
        ds_utils.set_z3_leaf_modules_by_name(net, ["nope"])
    found, missing = ds_utils.set_z3_leaf_modules_by_suffix(net, ["mlp", "attn", "zzz"], raise_if_not_found=False)
    assert found == [net.layers[0].mlp, net.layers[1].mlp, net.layers[0].attn, net.layers[1].attn]
    assert missing == ["zzz"]
    with pytest.raises(ValueError, match="zzz"):
        ds_utils.set_z3_leaf_modules_by_suffix(net, ["zzz"])
    # a leaf is a unit with no unit inside: each block's mlp (a Sequential) is gathered whole
    units = {u.name for u in choose_units(net, LeafRule())}
    assert {"layers.0.mlp", "layers.1.mlp"} <= units and not any(n.startswith("layers.0.mlp.") for n in units)
    assert ds_utils.set_z3_leaf_modules_by_name(net, ["layers.1.attn"], flag=False) == ([net.layers[1].attn], [])
    assert get_z3_leaf_modules(net) == [net.layers[0].attn, net.layers[0].mlp, net.layers[1].mlp]
    ds_utils.set_z3_leaf_modules_by_suffix(net, ["mlp", "attn"], flag=False)  # unmarked again
    assert get_z3_leaf_modules(net) == []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_update_full_grad_vectorized(stage):
    from lightspeed.testing.models import TinyMLP, regression_data

    torch.manual_seed(0)
    model = TinyMLP()
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}}
    engine, *_ = lightspeed.initialize(model=model, config=cfg, dist_init_required=False)
    x, y = regression_data(2)
    engine.backward(engine(x, y))
    params = [p for p in model.parameters() if p.requires_grad]
    before = [ds_utils.safe_get_full_grad(p).clone() for p in params]
    seen = []

    def double(grad, param):
        seen.append(param)
        return grad * 2

    ds_utils.safe_update_full_grad_vectorized(params, double)
    assert seen == params
    for p, b in zip(params, before):
        assert torch.equal(ds_utils.safe_get_full_grad(p), b * 2)
    # the step reads the updated gradients: SGD moves each parameter by lr * 2 * grad
    start = [ds_utils.safe_get_full_fp32_param(p).clone() for p in params]
    engine.step()
    for p, s, b in zip(params, start, before):
        torch.testing.assert_close(ds_utils.safe_get_full_fp32_param(p), s - 0.1 * 2 * b)

    free = torch.nn.Parameter(torch.ones(3))  # no engine manages it: its .grad is updated in place
    free.grad = torch.full((3,), 2.0)
    ds_utils.safe_update_full_grad_vectorized([free, torch.nn.Parameter(torch.ones(1))], lambda g, p: g + 1)
    assert torch.equal(free.grad, torch.full((3,), 3.0))


@pytest.mark.parametrize("stage", [2, 3])
def test_unwrap_model_for_generation_gathers_once(monkeypatch, stage):
    from lightspeed.testing.models import TinyMLP

    monkeypatch.setattr(stage3_options, "ONE_RANK_VIEWS", False)  # the gather machinery at one rank
    torch.manual_seed(0)
    cfg = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config=cfg, dist_init_required=False)
    x = torch.randn(2, 13)
    with torch.no_grad():
        expected = engine(x)
    with unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine
        assert all(p.numel() > 0 for p in engine.module.parameters())  # gathered
        if stage == 3:
            groups = engine.strategy.groups
            gathers = []
            for g in groups:
                g.gather = (lambda f: lambda: gathers.append(1) or f())(g.gather)
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(unwrapped(x), expected)
        if stage == 3:
            assert gathers == []  # no forward inside gathered anything
    if stage == 3:  # back to the shards
        assert all(p.numel() == 0 for p in engine.module.parameters())


def test_git_version_info():
    from lightspeed.compat.deepspeed import git_version_info as info

    assert info.version == "0.19.8" and info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert set(info.torch_info) == {"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}
    assert info.installed_ops["cpu_adam"] is False and info.compatible_ops["fused_adam"] is False  # none built
    assert info.accelerator_name == ("cuda" if torch.cuda.is_available() else "cpu")


def test_utils_torch():
    from lightspeed.compat.deepspeed.utils.torch import register_grad_hook, required_torch_version

    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert required_torch_version(min_version=1.13) and required_torch_version(min_version=major_minor)
    assert not required_torch_version(min_version=99.0) and not required_torch_version(max_version=1.0)
    assert required_torch_version(min_version=2.0, max_version=99)
    with pytest.raises(ValueError, match="min_version or a max_version"):
        required_torch_version()
    p = torch.nn.Parameter(torch.ones(2))
    seen = []
    handle = register_grad_hook(p, lambda param: seen.append(param.grad.clone()))
    (p * 3).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((2,), 3.0))
    handle.remove()
    (p * 3).sum().backward()
    assert len(seen) == 1


def test_op_builders_report_no_extension():
    from lightspeed.compat.deepspeed import ops
    from lightspeed.compat.deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder

    for builder in (FusedAdamBuilder, CPUAdamBuilder, FusedLambBuilder):
        assert ops.__compatible_ops__[builder.NAME] is False and not builder().is_compatible()
    assert FusedAdamBuilder.NAME == "fused_adam" and FusedAdamBuilder().absolute_name() == "deepspeed.ops.fused_adam_op"
    with pytest.raises(NotImplementedError, match="'cpu_adam'"):
        CPUAdamBuilder().load()


def test_checkpoint_file_names():
    u = ckpt_utils
    assert u.get_model_ckpt_name_for_rank("ck/tag", "00") == os.path.join("ck/tag", "mp_rank_00_model_states.pt")
    assert u.get_zero_ckpt_name_for_rank("d", 3, 1) == os.path.join("d", "zero_pp_rank_3_mp_rank_01_optim_states.pt")
    assert u.get_layer_ckpt_name_for_rank("d", "layer_01", 2) == os.path.join("d", "layer_01-model_02_model_states.pt")


@pytest.mark.no_real_deepspeed
def test_names_import_under_deepspeeds_module_paths():
    code = textwrap.dedent("""
        import lightspeed
        lightspeed.register_as_deepspeed()
        from deepspeed.runtime.config import ADAM_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, DeepSpeedConfig
        from deepspeed.runtime.lr_schedules import LR_SCHEDULE, WARMUP_NUM_STEPS
        from deepspeed.runtime.precision_config import DeepSpeedFP16Config, get_bfloat16_config
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, DeepSpeedZeroOffloadParamConfig
        from deepspeed.runtime.zero import unwrap_model_for_generation
        from deepspeed.utils import (safe_update_full_grad_vectorized, set_z3_leaf_modules_by_name,
                                     set_z3_leaf_modules_by_suffix)
        from deepspeed.checkpoint.utils import get_model_ckpt_name_for_rank
        import deepspeed
        assert deepspeed.zero.unwrap_model_for_generation is unwrap_model_for_generation
        assert deepspeed.runtime.zero.config.DeepSpeedZeroConfig is DeepSpeedZeroConfig
        print("OK")
    """)
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-3000:]


def test_deepspeed_config_data_types_as_deepspeed_holds_them():
    from lightspeed.compat.deepspeed.runtime.config import DeepSpeedConfig

    given = DeepSpeedConfig({"train_batch_size": 2, "data_types": {"grad_accum_dtype": "fp32", "buffer_dtype": "bf16",
                                                                   "keep_in_fp32_modules": ["*bias"]}})
    assert (given.grad_accum_dtype, given.param_dtype, given.buffer_dtype, given.keep_in_fp32_modules) == (
        "fp32", None, "bf16", ["*bias"])
    absent = DeepSpeedConfig({"train_batch_size": 2})  # DeepSpeed 0.19.8: None, None, None, "auto"
    assert (absent.grad_accum_dtype, absent.param_dtype, absent.buffer_dtype, absent.keep_in_fp32_modules) == (
        None, None, None, "auto")
