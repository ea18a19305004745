"""Every real-world ds_config in <repo>/../shared/configs loads, or fails naming the offending keys."""

import json
from pathlib import Path

import pytest

from lightspeed.config import ConfigError, load

SHARED = Path(__file__).resolve().parents[3] / ".." / "shared" / "configs"

pytestmark = pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared configs folder not present ({SHARED})")


def shared(name: str) -> Path:
    return SHARED / name


def all_files():
    return sorted(p.name for p in SHARED.glob("*.json")) if SHARED.is_dir() else []


def test_every_file_has_an_expectation():
    assert set(all_files()) <= set(EXPECTED), "a new shared config needs an expectation here"


def _autos(error: ConfigError) -> set[str]:
    return {p.split(":")[0] for p in error.problems if p.endswith('(got "auto")')}


def test_transformers_zero2_lists_every_auto_path():
    with pytest.raises(ConfigError) as info:
        load(shared("huggingface__transformers__ds_config_zero2.json"))
    assert _autos(info.value) == {
        "fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
        "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps", "gradient_accumulation_steps", "gradient_clipping",
        "train_batch_size", "train_micro_batch_size_per_gpu",
    }  # fmt: skip
    assert "HF Trainer" in str(info.value)


def test_accelerate_zero2_lists_every_auto_path():
    with pytest.raises(ConfigError) as info:
        load(shared("huggingface__accelerate__zero_stage2_offload_config.json"))
    assert _autos(info.value) == {
        "optimizer.params.lr", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps",
        "gradient_clipping", "train_batch_size", "train_micro_batch_size_per_gpu",
    }  # fmt: skip  (zero_optimization.reduce_bucket_size "auto" takes DeepSpeed's default, as DeepSpeed's)


def test_llama_factory_lists_autos_and_warns_about_its_own_keys(ls_caplog):
    with pytest.raises(ConfigError) as info:
        load(shared("hiyouga__LLaMA-Factory__ds_z3_offload_config.json"))
    assert _autos(info.value) == {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                  "gradient_clipping", "fp16.enabled", "bf16.enabled"}  # not zero_optimization's
    warned = ls_caplog.text
    assert '"comms_config"' in warned and '"monitor_config"' in warned


def test_llama_factory_with_autos_resolved_loads(ls_caplog):
    raw = json.loads(shared("hiyouga__LLaMA-Factory__ds_z3_offload_config.json").read_text())
    resolved = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                "gradient_clipping": 1.0}  # fmt: skip
    raw.update(resolved)
    raw["fp16"]["enabled"] = False
    raw["bf16"]["enabled"] = True
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        raw["zero_optimization"][key] = 1000
    cfg = load(raw, world_size=2, check_support=False)
    assert cfg.zero_optimization.stage == 3
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert cfg.zero_optimization.sub_group_size == 10**9 and isinstance(cfg.zero_optimization.sub_group_size, int)
    assert "comms_config" in cfg.raw and "comms_config" not in cfg.to_dict()
    assert "comms_config" in ls_caplog.text


def test_transformers_zero3_maps_legacy_key_then_needs_a_batch_size(ls_caplog):
    with pytest.raises(ConfigError) as info:
        load(shared("huggingface__transformers__ds_config_zero3.json"))
    assert "train_batch_size" in str(info.value) and "train_micro_batch_size_per_gpu" in str(info.value)
    assert "stage3_gather_fp16_weights_on_model_save" in ls_caplog.text


def test_transformers_zero3_with_a_batch_size_loads(ls_caplog):
    raw = json.loads(shared("huggingface__transformers__ds_config_zero3.json").read_text())
    raw["train_micro_batch_size_per_gpu"] = 4
    cfg = load(raw, check_support=False)
    zero = cfg.zero_optimization
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert zero.sub_group_size == 10**14 and isinstance(zero.sub_group_size, int)
    assert zero.stage3_max_live_parameters == 10**9
    assert zero.reduce_bucket_size == 0
    assert "stage3_gather_fp16_weights_on_model_save" not in cfg.raw["zero_optimization"]
    assert "deprecated" in ls_caplog.text
    full = load(raw)  # ZeRO-3 with optimizer and parameter offload: every setting is implemented
    assert full.zero_optimization.offload_optimizer_device == "cpu"
    assert full.zero_optimization.offload_param_device == "cpu"


def test_onebit_adam_world_size_must_divide_the_batch():
    path = shared("microsoft__DeepSpeedExamples__bing_bert_onebitadam_nccl.json")
    cfg = load(path, world_size=1, check_support=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4096, 16, 256)
    assert load(path, world_size=8, check_support=False).gradient_accumulation_steps == 32
    with pytest.raises(ConfigError, match=r"train_batch_size: must equal .* = 4080 \(got 4096"):
        load(path, world_size=3)
    assert load(path, world_size=1).optimizer.type == "OneBitAdam"  # implemented: the config loads


def test_zero_infinity_typo_is_named_with_a_suggestion():
    with pytest.raises(ConfigError) as info:
        load(shared("microsoft__DeepSpeedExamples__zero_infinity_nvme.json"))
    message = str(info.value)
    assert "zero_optimization.stage3_param_persitance_threshold" in message
    assert 'did you mean "stage3_param_persistence_threshold"' in message


def test_megatron_zero2_derives_the_micro_batch():
    path = shared("microsoft__DeepSpeedExamples__megatron_zero2_actckpt.json")
    cfg = load(path, world_size=4, check_support=False)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 1)
    assert cfg.activation_checkpointing.partition_activations is True
    assert load(path, world_size=4).activation_checkpointing.partition_activations is True  # ZeRO-2 and the block run


def test_pipeline_example_with_leading_space_and_trailing_comma_parses():
    cfg = load(shared("microsoft__DeepSpeedExamples__pipeline_parallelism_ds_config.json"), world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (256, 16, 8)
    assert cfg.optimizer.type == "Adam" and cfg.optimizer.params["betas"] == [0.9, 0.999]
    assert cfg.source.endswith("pipeline_parallelism_ds_config.json")


EXPECTED = {
    "huggingface__transformers__ds_config_zero2.json": test_transformers_zero2_lists_every_auto_path,
    "huggingface__transformers__ds_config_zero3.json": test_transformers_zero3_maps_legacy_key_then_needs_a_batch_size,
    "hiyouga__LLaMA-Factory__ds_z3_offload_config.json": test_llama_factory_lists_autos_and_warns_about_its_own_keys,
    "microsoft__DeepSpeedExamples__bing_bert_onebitadam_nccl.json": test_onebit_adam_world_size_must_divide_the_batch,
    "microsoft__DeepSpeedExamples__zero_infinity_nvme.json": test_zero_infinity_typo_is_named_with_a_suggestion,
    "microsoft__DeepSpeedExamples__megatron_zero2_actckpt.json": test_megatron_zero2_derives_the_micro_batch,
    "huggingface__accelerate__zero_stage2_offload_config.json": test_accelerate_zero2_lists_every_auto_path,
    "microsoft__DeepSpeedExamples__pipeline_parallelism_ds_config.json": test_pipeline_example_with_leading_space_and_trailing_comma_parses,
}


@pytest.mark.parametrize("name", all_files())
def test_file_loads_or_fails_clearly(name):
    """Generic check over every file: it parses, and any failure is a ConfigError or
    NotImplementedError naming at least one dotted key."""
    try:
        load(shared(name), world_size=1)
    except (ConfigError, NotImplementedError) as err:
        assert any(ch in str(err) for ch in ".:_")
