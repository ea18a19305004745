"""Precision policy: DeepSpeed's dtype defaults per mode, and the overrides."""

from types import SimpleNamespace

import pytest
import torch

from lightspeed.config.errors import ConfigError
from lightspeed.precision.policy import PrecisionPolicy, parse_dtype, policy_from_config

fp16, bf16, fp32 = torch.float16, torch.bfloat16, torch.float32


def test_fp32_default():
    for cfg in ({}, None, {"fp16": {"enabled": False}, "bf16": {"enabled": False}}):
        p = policy_from_config(cfg)
        assert p == PrecisionPolicy(fp32, fp32, fp32, fp32, None, False)
        assert not p.mixed


def test_fp16_defaults():
    p = policy_from_config({"fp16": {"enabled": True}})
    assert p == PrecisionPolicy(param_dtype=fp16, compute_dtype=fp16, grad_accum_dtype=fp16, reduce_dtype=fp16,
                                master_dtype=fp32, loss_scaling=True)
    assert p.mixed


def test_bf16_defaults_follow_current_deepspeed():
    p = policy_from_config({"bf16": {"enabled": True}})
    assert p == PrecisionPolicy(bf16, bf16, bf16, bf16, fp32, False)
    # Legacy section name DeepSpeed still reads.
    assert policy_from_config({"bfloat16": {"enabled": True}}).param_dtype == bf16


def test_overrides():
    p = policy_from_config({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                            "communication_data_type": "fp32", "zero_optimization": {"stage": 1}})
    assert (p.param_dtype, p.grad_accum_dtype, p.reduce_dtype, p.master_dtype) == (bf16, fp32, fp32, fp32)
    p = policy_from_config({"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "float32"},
                            "communication_data_type": "fp32", "zero_optimization": {"stage": 2}})
    assert (p.grad_accum_dtype, p.reduce_dtype, p.loss_scaling) == (fp32, fp32, True)
    p = policy_from_config({"communication_data_type": "bf16"})
    assert (p.param_dtype, p.reduce_dtype) == (fp32, bf16)


def test_sequence_parallel_reduces_in_seq_parallel_communication_data_type():
    # DeepSpeed's rule: with sp > 1 the gradient reduction dtype is seq_parallel_communication_data_type (fp32 default)
    assert policy_from_config({"bf16": {"enabled": True}, "sequence_parallel_size": 2}).reduce_dtype == fp32
    p = policy_from_config({"bf16": {"enabled": True}, "sequence_parallel_size": 2,
                            "communication_data_type": "fp32", "seq_parallel_communication_data_type": "bf16"})
    assert p.reduce_dtype == bf16
    assert policy_from_config({"bf16": {"enabled": True}, "sequence_parallel_size": 1}).reduce_dtype == bf16


def test_attribute_config():
    cfg = SimpleNamespace(fp16=SimpleNamespace(enabled=False), bf16=SimpleNamespace(enabled=True),
                          data_types=SimpleNamespace(grad_accum_dtype=None), communication_data_type=None)
    assert policy_from_config(cfg) == PrecisionPolicy(bf16, bf16, bf16, bf16, fp32, False)


def test_errors():
    with pytest.raises(ConfigError, match="at most one"):
        policy_from_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="data_types.grad_accum_dtype"):
        policy_from_config({"data_types": {"grad_accum_dtype": "fp8"}})
    # DeepSpeed's rule: without ZeRO the accumulation dtype is the model's; with ZeRO any combination
    for model, accum in (("fp32", "fp16"), ("fp16", "bf16"), ("bf16", "fp32"), ("fp16", "fp32")):
        section = {} if model == "fp32" else {("fp16" if model == "fp16" else "bf16"): {"enabled": True}}
        # a ConfigError that is also DeepSpeed's NotImplementedError for this "unsupported mix"
        with pytest.raises(NotImplementedError, match="data_types.grad_accum_dtype: without ZeRO .* stage 1, 2 or 3") as e:
            policy_from_config({**section, "data_types": {"grad_accum_dtype": accum}})
        assert isinstance(e.value, ConfigError)
        for stage in (1, 2, 3):
            p = policy_from_config({**section, "data_types": {"grad_accum_dtype": accum},
                                    "zero_optimization": {"stage": stage}})
            assert p.grad_accum_dtype == {"fp32": fp32, "fp16": fp16, "bf16": bf16}[accum]
    with pytest.raises(ConfigError, match="communication_data_type"):
        policy_from_config({"communication_data_type": "int8"})
    with pytest.raises(ConfigError, match="data_types.param_dtype"):
        policy_from_config({"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp32"}})
    assert policy_from_config({"bf16": {"enabled": True}, "data_types": {"param_dtype": "bf16"}}).param_dtype == bf16


def test_parse_dtype_spellings():
    assert parse_dtype("torch.bfloat16", "k") == bf16
    assert parse_dtype(" HALF ", "k") == fp16
    assert parse_dtype(torch.float32, "k") == fp32
    assert parse_dtype(None, "k") is None
    with pytest.raises(ConfigError):
        parse_dtype(torch.float64, "k")


def test_real_config_object():
    from lightspeed.config import load

    cfg = load({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"})
    assert policy_from_config(cfg) == PrecisionPolicy(bf16, bf16, fp32, fp32, fp32, False)
    cfg = load({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True}})
    assert policy_from_config(cfg) == PrecisionPolicy(fp16, fp16, fp16, fp16, fp32, True)
