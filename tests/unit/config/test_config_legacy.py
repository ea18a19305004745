"""Legacy and alias key names are mapped, with a warning for deprecated ones; contradictions are errors."""

import pytest

from lightspeed.config import ConfigError, load

BASE = {"train_micro_batch_size_per_gpu": 1}


def loaded(config):
    return load({**BASE, **config}, world_size=1, check_support=False)


def test_bfloat16_is_bf16(ls_caplog):
    cfg = loaded({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled is True
    assert "bfloat16" not in cfg.raw and cfg.raw["bf16"] == {"enabled": True}
    assert "bfloat16 is deprecated, read as bf16" in ls_caplog.text


def test_bfloat16_and_bf16_disagreeing():
    with pytest.raises(ConfigError, match="bfloat16: legacy name of bf16; both are given with different values"):
        loaded({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})


def test_bfloat16_and_bf16_agreeing(ls_caplog):
    assert loaded({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}}).bf16.enabled


def test_cpu_offload_flags(ls_caplog):
    cfg = loaded({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                        "cpu_offload_use_pin_memory": True}})  # fmt: skip
    zero = cfg.zero_optimization
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory is True
    assert zero.offload_param.device == "cpu" and zero.offload_param.pin_memory is True
    text = ls_caplog.text
    for name in ("cpu_offload is", "cpu_offload_param is", "cpu_offload_use_pin_memory is"):
        assert f"zero_optimization.{name} deprecated" in text
    assert "cpu_offload" not in cfg.raw["zero_optimization"]


def test_cpu_offload_false_is_no_offload(ls_caplog):
    assert loaded({"zero_optimization": {"cpu_offload": False}}).zero_optimization.offload_optimizer is None


def test_cpu_offload_merges_into_an_offload_block_without_device(ls_caplog):
    cfg = loaded({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"pin_memory": True}}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True


@pytest.mark.parametrize(
    "zero, fragment",
    [
        ({"cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "zero_optimization.cpu_offload: legacy name"),
        ({"cpu_offload": False, "offload_optimizer": {"device": "cpu"}}, "zero_optimization.cpu_offload: false contradicts"),
        ({"cpu_offload_param": True, "offload_param": {"device": "none"}}, "zero_optimization.cpu_offload_param: legacy name"),
        ({"cpu_offload_use_pin_memory": True, "offload_param": {"device": "cpu", "pin_memory": False}}, "cpu_offload_use_pin_memory: legacy name of zero_optimization.offload_param.pin_memory"),
        ({"cpu_offload": "yes"}, 'zero_optimization.cpu_offload: must be true or false (got "yes")'),
        ({"stage3_gather_fp16_weights_on_model_save": True, "stage3_gather_16bit_weights_on_model_save": False}, "stage3_gather_fp16_weights_on_model_save: legacy name"),
        ({"prefetch_bucket_size": 10, "stage3_prefetch_bucket_size": 11}, "zero_optimization.prefetch_bucket_size: legacy name of zero_optimization.stage3_prefetch_bucket_size"),
    ],
)  # fmt: skip
def test_old_and_new_names_disagreeing(zero, fragment, ls_caplog):
    with pytest.raises(ConfigError) as info:
        loaded({"zero_optimization": zero})
    assert fragment in str(info.value)


def test_gather_fp16_weights_is_gather_16bit_weights(ls_caplog):
    cfg = loaded({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}})
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert "stage3_gather_fp16_weights_on_model_save is deprecated" in ls_caplog.text


def test_unprefixed_stage3_field_names_are_aliases(ls_caplog):
    cfg = loaded({"zero_optimization": {"prefetch_bucket_size": 1e6, "max_live_parameters": 3,
                                        "gather_16bit_weights_on_model_save": True}})  # fmt: skip
    zero = cfg.zero_optimization
    assert zero.stage3_prefetch_bucket_size == 1_000_000 and zero.stage3_max_live_parameters == 3
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert ls_caplog.text == ""  # aliases, not deprecations


def test_boolean_zero_optimization(ls_caplog):
    cfg = loaded({"zero_optimization": True, "allgather_size": 1e8})
    assert cfg.zero_optimization.stage == 1 and cfg.zero_optimization.allgather_bucket_size == 100_000_000
    assert "deprecated format" in ls_caplog.text
    assert loaded({"zero_optimization": False}).zero_optimization.stage == 0


def test_optimizer_torch_adam_beside_type_is_ignored_as_deepspeed_does(ls_caplog):
    cfg = loaded({"optimizer": {"type": "Adam", "torch_adam": True, "params": {"lr": 0.1}}})
    assert cfg.optimizer.params == {"lr": 0.1} and "torch_adam" not in cfg.raw["optimizer"]
    assert "optimizer.torch_adam (true) has no effect there" in ls_caplog.text
