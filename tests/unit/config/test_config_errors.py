"""Bad configs: every problem is named by its dotted path, with what was expected and what was given,
and all problems come back in one ConfigError."""

import pytest

from lightspeed.config import ConfigError, load

BASE = {"train_micro_batch_size_per_gpu": 2}


def problems(config, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load({**BASE, **config}, world_size=1, **kwargs)
    return info.value.problems


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage: must be 0, 1, 2 or 3 (got 4)"),
        ({"zero_optimization": {"stage": "2"}}, 'zero_optimization.stage: must be 0, 1, 2 or 3 (got "2")'),
        ({"fp16": {"loss_scale": "big"}}, 'fp16.loss_scale: must be a number >= 0 (got "big")'),
        ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale: must be a number >= 0 (got -1)"),
        ({"fp16": {"loss_scale": True}}, "fp16.loss_scale: must be a number >= 0 (got true)"),
        ({"fp16": {"enabled": "yes"}}, 'fp16.enabled: must be true or false (got "yes")'),
        ({"fp16": {"enabled": 1}}, "fp16.enabled: must be true or false (got 1)"),
        ({"fp16": {"initial_scale_power": 2.5}}, "fp16.initial_scale_power: must be an integer >= 0 (got 2.5)"),
        ({"gradient_clipping": "1.0"}, 'gradient_clipping: must be a number >= 0 (got "1.0")'),
        ({"steps_per_print": True}, "steps_per_print: must be a positive integer (got true)"),
        ({"zero_optimization": {"reduce_bucket_size": 2.5}}, "zero_optimization.reduce_bucket_size: must be an integer >= 0 (got 2.5)"),
        ({"zero_optimization": {"allgather_bucket_size": True}}, "zero_optimization.allgather_bucket_size: must be an integer >= 0 (got true)"),
        ({"zero_optimization": 3}, "zero_optimization: must be an object (got 3)"),
        ({"optimizer": "adam"}, 'optimizer: must be an object (got "adam")'),
        ({"optimizer": {"params": {}}}, "optimizer.type: is required"),
        ({"optimizer": {"type": "Adam", "params": [1]}}, "optimizer.params: must be an object (got [1])"),
        ({"communication_data_type": "int8"}, 'communication_data_type: must be "fp16", "bf16" or "fp32" (got "int8")'),
        ({"data_types": {"grad_accum_dtype": "fp64"}}, 'data_types.grad_accum_dtype: must be "fp32", "fp16" or "bf16" (got "fp64")'),
        ({"checkpoint": {"tag_validation": "loud"}}, 'checkpoint.tag_validation: must be "Warn", "Ignore" or "Fail" (got "loud")'),
        ({"checkpoint": {"writer": {"snapshot_pool": "eager"}}}, 'checkpoint.writer.snapshot_pool: must be "first_save" or "startup" (got "eager")'),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
            'zero_optimization.offload_optimizer.device: must be "none", "cpu" or "nvme" (got "gpu")',
        ),
        ({"pipeline": {"stages": 0}}, 'pipeline.stages: must be "auto" or a positive integer (got 0)'),
        ({"comms_logger": {"prof_ops": [1]}}, "comms_logger.prof_ops: must be a list of strings (got [1])"),
    ],
)  # fmt: skip
def test_wrong_value_is_named(config, expected):
    assert expected in problems(config)


@pytest.mark.parametrize(
    "config, path, suggestion",
    [
        ({"zero_optimization": {"stage3_param_persitance_threshold": 1}}, "zero_optimization.stage3_param_persitance_threshold", "stage3_param_persistence_threshold"),
        ({"fp16": {"initial_scale_pow": 8}}, "fp16.initial_scale_pow", "initial_scale_power"),
        ({"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}}, "zero_optimization.offload_optimizer.pin_memroy", "pin_memory"),
        ({"bf16": {"enable": True}}, "bf16.enable", "enabled"),
        ({"checkpoint": {"writer": {"tpye": "fast"}}}, "checkpoint.writer.tpye", "type"),
    ],
)  # fmt: skip
def test_unknown_nested_key_suggests_the_known_one(config, path, suggestion):
    assert f'{path}: unknown key; did you mean "{suggestion}"?' in problems(config)


def test_unknown_nested_key_without_a_close_match_has_no_suggestion():
    assert "tensorboard.colour: unknown key" in problems({"tensorboard": {"colour": "blue"}})


@pytest.mark.parametrize(
    "key, suggestion",
    [("train_batch_sz", "train_batch_size"), ("zero_optimisation", "zero_optimization"), ("Fp16", "fp16"),
     ("fp61", "fp16"), ("gradient_acumulation_steps", "gradient_accumulation_steps"), ("bf-16", "bf16")],
)  # fmt: skip
def test_top_level_typo_is_an_error(key, suggestion):
    assert f'{key}: unknown top-level key; did you mean "{suggestion}"?' in problems({key: 1})


@pytest.mark.parametrize("key", ["comms_config", "monitor_config", "my_project_settings", "wibble"])
def test_other_unknown_top_level_keys_warn(key, ls_caplog):
    cfg = load({**BASE, key: {"enabled": True}}, world_size=1)
    assert f'unknown top-level key "{key}"' in ls_caplog.text
    assert cfg.raw[key] == {"enabled": True}


def test_misplaced_section_key_warning_points_to_its_section(ls_caplog):
    load({**BASE, "offload_optimizer": {"device": "cpu"}}, world_size=1)
    assert "zero_optimization.offload_optimizer" in ls_caplog.text


def test_fp16_and_bf16_together():
    found = problems({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert any(p.startswith("fp16.enabled, bf16.enabled:") and "cannot both be enabled" in p for p in found)


def test_dynamic_loss_scale_needs_positive_window():
    assert "fp16.loss_scale_window: must be > 0 with dynamic loss scaling (loss_scale 0) (got 0)" in problems(
        {"fp16": {"enabled": True, "loss_scale_window": 0}}
    )
    load({**BASE, "fp16": {"enabled": True, "loss_scale": 128, "loss_scale_window": 0}}, world_size=1)


def test_cross_section_rules():
    found = problems({"bf16": {"enabled": True, "bf16_optimizer_states": True},
                      "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}})  # fmt: skip
    assert any(p.startswith("bf16.bf16_optimizer_states: needs zero_optimization.stage") for p in found)
    assert any(p.startswith("bf16.bf16_optimizer_states: needs bf16.bf16_master_weights_and_grads") for p in found)
    assert any(p.startswith("zero_optimization.offload_optimizer.ratio:") for p in found)
    unmanaged = {"managed_gradient_accumulation": False}
    assert problems({**unmanaged, "zero_optimization": {"stage": 1, "overlap_comm": True}}) == [
        "managed_gradient_accumulation: false supports zero_optimization.overlap_comm only with ZeRO stage 2 or 3 "
        "(got stage 1 with overlap_comm true)"]
    for stage in (1, 3):  # overlap_comm defaults to stage == 3, which the rule accepts
        load({**BASE, **unmanaged, "zero_optimization": {"stage": stage}}, world_size=1)
    assert problems({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}) == [
        'gradient_allreduce_op: "sum" is not supported with zero_optimization.stage 3 (got "sum")']
    assert 'zero_optimization.offload_param.nvme_path: is required when device is "nvme"' in problems(
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    )


def test_integral_floats_are_integers():
    cfg = load({**BASE, "zero_optimization": {"allgather_bucket_size": 2e8, "reduce_bucket_size": 5e8,
                                              "sub_group_size": 1e14, "stage": 0.0}}, world_size=1)  # fmt: skip
    zero = cfg.zero_optimization
    assert zero.allgather_bucket_size == 200_000_000 and type(zero.allgather_bucket_size) is int
    assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.sub_group_size == 10**14 and type(zero.sub_group_size) is int
    assert type(zero.stage) is int
    assert type(load({"train_batch_size": 8.0}, world_size=1).train_batch_size) is int


def test_non_integral_float_is_rejected():
    assert "zero_optimization.allgather_bucket_size: must be an integer >= 0 (got 2.5)" in problems(
        {"zero_optimization": {"allgather_bucket_size": 2.5}}
    )


def test_booleans_are_not_numbers():
    found = problems({"gradient_accumulation_steps": True, "gradient_clipping": False})
    assert "gradient_accumulation_steps: must be a positive integer (got true)" in found
    assert "gradient_clipping: must be a number >= 0 (got false)" in found


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        load({"train_batch_sz": 8, "zero_optimization": {"stage": 7, "overlap_com": True},
              "fp16": {"enabled": True, "loss_scale": "x"}, "bf16": {"enabled": True},
              "optimizer": {"type": 1}}, world_size=1)  # fmt: skip
    message = str(info.value)
    assert message.startswith("6 problems in the config:")
    for fragment in ("train_batch_sz: unknown top-level key", "zero_optimization.stage: must be 0, 1, 2 or 3 (got 7)",
                     'zero_optimization.overlap_com: unknown key; did you mean "overlap_comm"?',
                     'fp16.loss_scale: must be a number >= 0 (got "x")', "optimizer.type: must be a string (got 1)",
                     "train_batch_size, train_micro_batch_size_per_gpu: at least one must be given"):  # fmt: skip
        assert fragment in message
    assert "validation error" not in message and "pydantic" not in message


def test_auto_values_are_all_listed():
    with pytest.raises(ConfigError) as info:
        load({"train_batch_size": "auto", "fp16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": ["auto", 0.999]}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}})  # fmt: skip
    err = info.value
    autos = [p.split(":")[0] for p in err.problems if p.endswith('(got "auto")')]
    assert autos == ["train_batch_size", "fp16.enabled", "optimizer.params.lr", "optimizer.params.betas[0]"]
    assert "Hugging Face" in str(err) and "HF Trainer" in str(err)


def test_auto_deepspeed_drops_takes_deepspeeds_default(ls_caplog):
    """DeepSpeed's pydantic sections drop an "auto" key (its default applies): the keys directly inside
    zero_optimization, tensor_parallel, comms_logger, hybrid_engine and timers.throughput."""
    ls_caplog.set_level("INFO", logger="lightspeed")
    default = load(BASE, world_size=1)
    cfg = load({**BASE, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size":
                                              "auto", "stage3_param_persistence_threshold": "auto",
                                              "stage3_max_live_parameters": 1e9},
                "tensor_parallel": {"autotp_size": "auto"}, "comms_logger": {"verbose": "auto"},
                "hybrid_engine": {"enabled": "auto"}, "timers": {"throughput": {"synchronized": "auto"}}},
               world_size=1)  # fmt: skip
    zero, zero_default = cfg.zero_optimization, default.zero_optimization
    assert zero.stage == 3 and zero.stage3_max_live_parameters == 10**9
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        assert getattr(zero, key) == getattr(zero_default, key)
    assert cfg.tensor_parallel.autotp_size == default.tensor_parallel.autotp_size
    assert cfg.comms_logger.verbose is False and cfg.hybrid_engine.enabled is False
    assert cfg.timers.throughput.synchronized is True
    assert 'config: zero_optimization.reduce_bucket_size is "auto": DeepSpeed\'s default applies' in ls_caplog.text
    # one level deeper DeepSpeed validates the nested section without dropping: "auto" is refused there
    found = problems({"zero_optimization": {"stage": 3, "offload_param": {"device": "auto"}}})
    assert found[-1] == 'zero_optimization.offload_param.device: must be a concrete value (got "auto")'


def test_auto_where_deepspeed_defines_it_is_accepted():
    cfg = load({**BASE, "pipeline": {"stages": "auto"}, "expert_parallel": {"top_k": "auto"}}, world_size=1,
               check_support=False)  # fmt: skip
    assert cfg.pipeline.stages == "auto"


def test_world_size_argument_is_checked():
    with pytest.raises(ConfigError, match="world_size: must be a positive integer"):
        load(BASE, world_size=0)


def test_cross_section_rules_still_run_when_another_section_is_invalid():
    found = problems({"fp16": {"enabled": True}, "bf16": {"enabled": True}, "tensorboard": {"enabled": "y"}})
    assert 'tensorboard.enabled: must be true or false (got "y")' in found
    assert any("cannot both be enabled" in p for p in found)
    # ...but not rules about an invalid section, whose defaults would make them misleading
    found = problems({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, "zero_optimization": {"stage": 9}})
    assert found == ["zero_optimization.stage: must be 0, 1, 2 or 3 (got 9)"]


def test_known_misname_of_a_top_level_key():
    assert 'seq_parallel_comm_data_type: unknown top-level key; did you mean "seq_parallel_communication_data_type"?' in (
        problems({"seq_parallel_comm_data_type": "bf16"})
    )


def test_deepspeed_warnings(ls_caplog):
    load({**BASE, "vocabulary_size": 50257, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, world_size=1)
    assert "vocabulary_size 50257" in ls_caplog.text and "max_grad_norm" in ls_caplog.text
