"""Defaults equal DeepSpeed's (runtime/constants.py, precision_config.py, zero/config.py,
zero/offload_config.py, monitor/config.py, profiling/constants.py, ...), for a sample of keys per
section; to_dict() shows every key."""

import json
import re
import sys

import pytest

from lightspeed.config import ConfigError, load

CFG = load({"train_micro_batch_size_per_gpu": 1}, world_size=1)


@pytest.mark.parametrize(
    "path, default",
    [
        ("steps_per_print", None), ("wall_clock_breakdown", False), ("dump_state", False), ("gradient_clipping", 1.0),
        ("prescale_gradients", False), ("gradient_predivide_factor", 1.0), ("sparse_gradients", False),
        ("memory_breakdown", False), ("zero_allow_untested_optimizer", False), ("zero_force_ds_cpu_optimizer", True),
        ("communication_data_type", None), ("seq_parallel_communication_data_type", "fp32"), ("optimizer", None),
        ("scheduler", None), ("gradient_allreduce_op", "mean"),
        ("fp16.enabled", False), ("fp16.auto_cast", False), ("fp16.loss_scale", 0), ("fp16.initial_scale_power", 16),
        ("fp16.loss_scale_window", 1000), ("fp16.hysteresis", 2), ("fp16.consecutive_hysteresis", False),
        ("fp16.min_loss_scale", 1), ("fp16.fp16_master_weights_and_grads", False),
        ("bf16.enabled", False), ("bf16.immediate_grad_update", False), ("bf16.check_grad_overflow", True),
        ("bf16.bf16_master_weights_and_grads", False), ("bf16.bf16_optimizer_states", False),
        ("amp.enabled", False), ("torch_autocast.enabled", False), ("data_types.grad_accum_dtype", None),
        ("zero_optimization.stage", 0), ("zero_optimization.contiguous_gradients", True),
        ("zero_optimization.reduce_scatter", True), ("zero_optimization.reduce_bucket_size", 500_000_000),
        ("zero_optimization.allgather_partitions", True), ("zero_optimization.allgather_bucket_size", 500_000_000),
        ("zero_optimization.overlap_comm", False), ("zero_optimization.load_from_fp32_weights", True),
        ("zero_optimization.sub_group_size", 1_000_000_000), ("zero_optimization.stage3_prefetch_bucket_size", 50_000_000),
        ("zero_optimization.stage3_param_persistence_threshold", 100_000),
        ("zero_optimization.stage3_model_persistence_threshold", sys.maxsize),
        ("zero_optimization.stage3_max_live_parameters", 1_000_000_000),
        ("zero_optimization.stage3_max_reuse_distance", 1_000_000_000),
        ("zero_optimization.stage3_gather_16bit_weights_on_model_save", False),
        ("zero_optimization.ignore_unused_parameters", True), ("zero_optimization.round_robin_gradients", False),
        ("zero_optimization.zero_hpz_partition_size", 1), ("zero_optimization.zero_quantized_weights", False),
        ("zero_optimization.zero_quantized_gradients", False), ("zero_optimization.mics_shard_size", -1),
        ("zero_optimization.offload_optimizer", None), ("zero_optimization.offload_param", None),
        ("activation_checkpointing.partition_activations", False), ("activation_checkpointing.number_checkpoints", None),
        ("flops_profiler.enabled", False), ("flops_profiler.profile_step", 1), ("flops_profiler.module_depth", -1),
        ("flops_profiler.top_modules", 1), ("flops_profiler.detailed", True), ("flops_profiler.output_file", None),
        ("tensorboard.enabled", False), ("tensorboard.job_name", "DeepSpeedJobName"), ("wandb.project", "deepspeed"),
        ("csv_monitor.enabled", False), ("comet.samples_log_interval", 100), ("comms_logger.prof_all", True),
        ("comms_logger.verbose", False), ("checkpoint.tag_validation", "WARN"), ("checkpoint.load_universal", False),
        ("aio.block_size", 1_048_576), ("aio.queue_depth", 8), ("aio.thread_count", 1), ("aio.single_submit", False),
        ("aio.overlap_events", True), ("pipeline.stages", "auto"), ("pipeline.partition", "best"),
        ("pipeline.activation_checkpoint_interval", 0), ("elasticity.max_train_batch_size", 2000),
        ("elasticity.micro_batch_sizes", [2, 4, 6]), ("autotuning.start_profile_step", 3),
        ("autotuning.end_profile_step", 5), ("autotuning.metric", "throughput"), ("progressive_layer_drop.theta", 1.0),
        ("progressive_layer_drop.gamma", 0.001), ("data_efficiency.seed", 1234), ("sparse_attention", None),
        ("eigenvalue.max_iter", 100), ("curriculum_learning.enabled", False), ("timers.throughput.enabled", True),
        ("comm.timeout_seconds", 600.0), ("comm.stall_seconds", 60.0),
        # keys DeepSpeed 0.19.8 reads that its earlier releases did not
        ("log_level", None), ("data_types.keep_in_fp32_modules", "auto"), ("compile.autoep_non_moe", False),
        ("compile.offload_activation_pin_memory", True), ("tensor_parallel.vocab_parallel_lm_head", None),
        ("tensor_parallel.vocab_parallel_ce_backend", "torch"), ("expert_parallel.async_split_plan", False),
        ("expert_parallel.row_weighting_impl", "auto"), ("expert_parallel.gate_up_impl", "separate"),
        ("expert_parallel.comm_backend", "comm"), ("expert_parallel.comm_num_sm", 12),
        ("expert_parallel.comm_qp_margin", 4), ("expert_parallel.comm_max_tokens_per_rank", 0),
        ("expert_parallel.expert_activation", None),
    ],
)  # fmt: skip
def test_default(path, default):
    value = CFG
    for part in path.split("."):
        value = getattr(value, part)
    assert value == default


def test_offload_block_defaults():
    zero = load({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "offload_optimizer": {},
                 "offload_param": {}}}, world_size=1, check_support=False).zero_optimization  # fmt: skip
    assert zero.overlap_comm is True  # DeepSpeed's dynamic default for stage 3
    assert (zero.offload_optimizer.device, zero.offload_optimizer.buffer_count, zero.offload_optimizer.ratio) == ("none", 4, 1.0)
    assert (zero.offload_param.device, zero.offload_param.buffer_count, zero.offload_param.max_in_cpu) == ("none", 5, 10**9)
    assert zero.offload_param.buffer_size == 10**8
    # pinned host memory by default since DeepSpeed 0.19.4 (its #8207)
    assert zero.offload_param.pin_memory is True and zero.offload_optimizer.pin_memory is True


def test_sparse_attention_defaults():
    cfg = load({"train_micro_batch_size_per_gpu": 1, "sparse_attention": {}}, world_size=1, check_support=False)
    sa = cfg.sparse_attention
    assert (sa.mode, sa.block, sa.num_local_blocks, sa.attention, sa.local_window_blocks) == ("fixed", 16, 4, "bidirectional", [4])


def test_to_dict_has_every_key_with_defaults_and_is_json():
    d = CFG.to_dict()
    json.dumps(d)
    assert d["train_batch_size"] == 1 and d["gradient_accumulation_steps"] == 1
    assert d["fp16"]["initial_scale_power"] == 16 and d["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert d["zero_optimization"]["offload_optimizer"] is None
    assert set(d) >= {"fp16", "bf16", "zero_optimization", "tensorboard", "aio", "pipeline", "elasticity", "autotuning"}


def test_sections_are_independent_between_configs():
    a = load({"train_micro_batch_size_per_gpu": 1}, world_size=1)
    a.fp16.enabled = True
    a.zero_optimization.leaf_module.names.append("x")
    b = load({"train_micro_batch_size_per_gpu": 1}, world_size=1)
    assert b.fp16.enabled is False and b.zero_optimization.leaf_module.names == []


def test_case_insensitive_names_are_normalized():
    cfg = load({"train_micro_batch_size_per_gpu": 1, "communication_data_type": "BF16",
                "checkpoint": {"tag_validation": "Fail"}}, world_size=1)  # fmt: skip
    assert cfg.communication_data_type == "bf16" and cfg.checkpoint.tag_validation == "FAIL"


def test_raw_keeps_the_mapped_input():
    cfg = load({"train_batch_size": 4, "bfloat16": {"enabled": True}, "extra_key": 1}, world_size=1)
    assert cfg.raw == {"train_batch_size": 4, "bf16": {"enabled": True}, "extra_key": 1}


def test_amp_passes_other_keys_through():
    cfg = load({"train_micro_batch_size_per_gpu": 1, "amp": {"enabled": False, "opt_level": "O1"}}, world_size=1)
    assert cfg.amp.params() == {"opt_level": "O1"}


# DeepSpeed 0.19.8's keys that lightspeed parses but does not build: refused by key when set, never ignored
@pytest.mark.parametrize(
    "extra, refused",
    [
        ({"compile": {"autoep_non_moe": True}}, "autoep_non_moe=true"),
        ({"compile": {"offload_activation_pin_memory": False}}, "offload_activation_pin_memory=false"),
        ({"tensor_parallel": {"vocab_parallel_lm_head": True}}, "tensor_parallel.vocab_parallel_lm_head=true"),
        ({"tensor_parallel": {"vocab_parallel_ce_backend": "liger"}}, "tensor_parallel.vocab_parallel_ce_backend"),
    ],
)  # fmt: skip
def test_new_deepspeed_keys_are_refused_when_set(extra, refused):
    with pytest.raises(NotImplementedError, match=re.escape(refused)):
        load({"train_micro_batch_size_per_gpu": 1, **extra}, world_size=1)


@pytest.mark.parametrize("value", ["auto", [], ["*bias", "gate.e_score_correction_bias"]])
def test_buffer_dtype_and_keep_in_fp32_modules_are_built(value):  # lightspeed/precision/module_dtypes.py
    cfg = load({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                "data_types": {"buffer_dtype": "BF16", "keep_in_fp32_modules": value}}, world_size=1)
    assert cfg.data_types.keep_in_fp32_modules == value and cfg.data_types.buffer_dtype == "bf16"


def test_keep_in_fp32_modules_other_values_are_refused():
    with pytest.raises(ConfigError, match="data_types.keep_in_fp32_modules"):
        load({"train_micro_batch_size_per_gpu": 1, "data_types": {"keep_in_fp32_modules": "none"}}, world_size=1)


def test_sequence_parallel_dtype_key_is_deepspeeds_current_name():
    cfg = load({"train_micro_batch_size_per_gpu": 1, "seq_parallel_communication_data_type": "BF16"}, world_size=1)
    assert cfg.seq_parallel_communication_data_type == "bf16"


@pytest.mark.parametrize("section, key", [("zero_optimization.offload_optimizer", "convert_grad_on_cpu"),
                                          ("zero_optimization.offload_optimizer", "buffer_size"),
                                          ("aio", "io_backend")])
def test_keys_deepspeed_does_not_have_are_unknown(section, key):
    # none of these is a DeepSpeed 0.19.8 key (its offload blocks refuse them; it ignores aio's)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    parent = config
    for part in section.split("."):
        parent = parent.setdefault(part, {})
    parent[key] = 1
    with pytest.raises(ConfigError, match=re.escape(f"{section}.{key}: unknown key")):
        load(config, world_size=1)


def test_cpuadam_cores_perc_is_refused_when_changed():
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True, "cpuadam_cores_perc": 0.5}}
    with pytest.raises(NotImplementedError, match="offload_optimizer.cpuadam_cores_perc=0.5"):
        load({"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}, world_size=1)


def test_log_level_sets_the_logger_at_initialize():
    import logging

    import lightspeed
    from lightspeed._utils.logging import get_logger
    from lightspeed.testing.models import TinyMLP

    root = get_logger()
    before = root.level
    try:
        lightspeed.initialize(model=TinyMLP(), config={"train_micro_batch_size_per_gpu": 1, "log_level": "ERROR",
                                                        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
                              dist_init_required=False)
        assert root.level == logging.ERROR and all(h.level == logging.ERROR for h in root.handlers)
    finally:
        root.setLevel(before)
        for h in root.handlers:
            h.setLevel(logging.NOTSET)
