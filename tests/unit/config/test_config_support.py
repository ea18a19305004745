"""The not-yet-implemented registry: what is implemented loads, every enabled unimplemented setting
is named at once."""

import pytest

from lightspeed.config import check_supported, load
from lightspeed.config.support import UNIMPLEMENTED, unimplemented_features

BASE = {"train_batch_size": 8}


def features(config) -> list[str]:
    return unimplemented_features(load({**BASE, **config}, world_size=1, check_support=False))


def test_implemented_features_load():
    cfg = load({
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 5,
        "wall_clock_breakdown": True, "gradient_clipping": 1.0, "prescale_gradients": True,
        "gradient_predivide_factor": 2.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 2},
        "zero_optimization": {"stage": 0}, "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32", "checkpoint": {"tag_validation": "Fail"},
        "memory_breakdown": True, "dump_state": True, "aio": {"block_size": 1048576},
        "zero_optimization_unused_extra": 1,
    }, world_size=1)  # fmt: skip
    check_supported(cfg)
    assert cfg.gradient_accumulation_steps == 4


def test_stage_message_and_all_named_at_once():
    with pytest.raises(NotImplementedError) as info:
        load({**BASE, "zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, world_size=1)
    assert str(info.value) == "zero_optimization.zero_quantized_weights=true is not implemented yet"
    with pytest.raises(NotImplementedError) as info:
        load({**BASE, "zero_optimization": {"stage": 2, "zero_quantized_weights": True,
                                            "zero_quantized_gradients": True},
              "trackio": {"enabled": True}, "fp16": {"enabled": True, "auto_cast": True}}, world_size=1)  # fmt: skip
    message = str(info.value)
    assert message.startswith("4 config settings are not implemented yet:")
    for line in ("zero_optimization.zero_quantized_gradients=true", "zero_optimization.zero_quantized_weights=true",
                 "trackio.enabled=true", "fp16.auto_cast=true"):  # fmt: skip
        assert f"  {line} is not implemented yet" in message


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"zero_optimization": {"zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size=8"),
        ({"zero_optimization": {"zero_quantized_gradients": True}}, "zero_optimization.zero_quantized_gradients=true"),
        ({"zero_optimization": {"zero_quantized_nontrainable_weights": True}}, "zero_optimization.zero_quantized_nontrainable_weights=true"),
        ({"zero_optimization": {"mics_shard_size": 4}}, "zero_optimization.mics_shard_size=4"),
        ({"amp": {"enabled": True, "opt_level": "O2"}}, "amp.enabled=true"),
        ({"trackio": {"enabled": True}}, "trackio.enabled=true"),
        ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}}, "compression_training (weight_quantization)"),
        ({"data_efficiency": {"enabled": True}}, "data_efficiency.enabled=true"),
        ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}}, "curriculum_learning.enabled=true"),
        ({"autotuning": {"enabled": True, "model_info": {"profile": True}}},
         "autotuning.model_info.profile=true (DeepSpeed's model-info profile run, which writes "
         "autotuning.model_info_path; lightspeed's autotuner calibrates from a profiled step instead)"),
        ({"progressive_layer_drop": {"enabled": True}}, "progressive_layer_drop.enabled=true"),
        ({"checkpoint": {"writer": {"type": "fast"}}}, 'checkpoint.writer.type="FAST" (DeepSpeed\'s DeepNVMe writer through pinned I/O buffers; "PYTHON", decoupled or not, is built)'),
        ({"checkpoint": {"writer": {"type": "mock", "decoupled": True}}}, 'checkpoint.writer.type="MOCK" (DeepSpeed\'s writer that writes nothing; "PYTHON", decoupled or not, is built)'),
        ({"checkpoint": {"writer": {"type": "python", "data_parallel": "replica"}}}, 'checkpoint.writer.data_parallel="REPLICA"'),
        ({"checkpoint": {"writer": {"type": "python", "io_multiplier": 2}}}, "checkpoint.writer.io_multiplier=2"),
        ({"checkpoint": {"checkpoint_serialization": False}}, "checkpoint.checkpoint_serialization=false (torch's legacy, non-zip file format)"),
        ({"checkpoint": {"load_universal": True}}, "checkpoint.load_universal=true"),
        ({"tensor_parallel": {"tp_overlap_comm": True}}, "tensor_parallel.tp_overlap_comm=true"),
    ],
)  # fmt: skip
def test_registered_feature_is_named(config, expected):
    assert f"{expected} is not implemented yet" in features(config)


def test_default_config_has_no_unimplemented_features():
    assert features({}) == []


def test_pipeline_section_is_implemented():
    assert features({"pipeline": {"stages": 2, "schedule": "zbv_zero_bubble", "activation_checkpoint_interval": 1}}) == []


@pytest.mark.parametrize("section", ["tensorboard", "csv_monitor", "wandb", "comet", "flops_profiler"])
def test_monitors_and_flops_profiler_are_implemented(section):
    assert features({section: {"enabled": True}}) == []


def test_registry_is_one_list_of_entries_with_paths():
    paths = [entry.path for entry in UNIMPLEMENTED]
    assert "zero_optimization.stage" in paths and all(isinstance(p, str) and p for p in paths)
