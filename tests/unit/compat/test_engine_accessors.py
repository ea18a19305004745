"""DeepSpeed 0.19.8's engine getters of the configuration (runtime/engine_accessors.py), on one-process
engines: each answer is DeepSpeed's for the same config, and the batch-size setters refuse."""

import pytest
import torch

import lightspeed
from lightspeed.testing.models import TinyMLP


def _engine(config, **kwargs):
    engine, *_ = lightspeed.initialize(model=TinyMLP(), config={"train_micro_batch_size_per_gpu": 2, **config},
                                       dist_init_required=False, **kwargs)
    return engine


def test_config_optimizer_scheduler_and_zero_getters():
    engine = _engine({"gradient_accumulation_steps": 3, "prescale_gradients": True,
                      "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
                      "zero_optimization": {"stage": 2, "reduce_bucket_size": 1234, "overlap_comm": True,
                                            "offload_optimizer": {"device": "cpu"}}})
    assert (engine.optimizer_name(), engine.optimizer_params()) == ("adamw", {"lr": 0.01, "betas": [0.8, 0.9]})
    assert (engine.scheduler_name(), engine.scheduler_params()) == ("WarmupLR", {"warmup_num_steps": 5})
    assert engine.get_mom() == [(0.8, 0.9)] * len(engine.optimizer.param_groups)
    assert engine.get_type() == [0.0] * len(engine.optimizer.param_groups)
    assert engine.get_batch_info() == (6, 2, 3)
    assert engine.zero_optimization() and engine.zero_reduce_bucket_size() == 1234 and engine.zero_overlap_comm()
    assert engine.zero_cpu_offload() and engine.zero_use_cpu_optimizer() and engine.zero_partial_offload() == 1.0
    assert engine.zero_offload_optimizer().device == "cpu" and engine.zero_offload_param() is None
    assert engine.zero_prefetch_bucket_size() == engine.config.zero_optimization.stage3_prefetch_bucket_size
    assert engine.zero_max_live_parameters.__name__ == "zero_max_live_parameters"
    assert not engine.postscale_gradients() and engine.gradient_predivide_factor() == 1.0
    assert engine.communication_data_type == torch.float32 and not engine.wall_clock_breakdown()
    assert engine.get_data_parallel_rank() == 0 and engine.get_sequence_parallel_group() is None
    assert engine.zero_force_ds_cpu_optimizer() and not engine.zero_allow_untested_optimizer()
    assert engine.log_level() is None and not engine.dump_state()


def test_precision_getters_and_defaults():
    engine = _engine({"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 3},
                      "flops_profiler": {"enabled": True}})
    assert engine.dynamic_loss_scale() and engine.initial_dynamic_scale() == 256
    assert engine.dynamic_loss_scale_args() == {"init_scale": 256, "scale_window": 1000, "delayed_shift": 3,
                                                "consecutive_hysteresis": False, "min_scale": 1}
    assert engine.communication_data_type == torch.float16 and engine.wall_clock_breakdown()  # the profiler's
    assert engine.optimizer_name() is None and engine.optimizer_params() is None and engine.get_mom() == []
    assert not engine.zero_optimization() and not engine.zero_cpu_offload() and engine.zero_partial_offload() == 1.0
    assert not _engine({"fp16": {"enabled": True, "loss_scale": 128}}).dynamic_loss_scale()
    bf16 = _engine({"bf16": {"enabled": True}, "communication_data_type": "fp32"})
    assert bf16.communication_data_type == torch.float32 and bf16.get_data_types() == (torch.bfloat16,) * 2
    zero = _engine({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                    "zero_optimization": {"stage": 1}})
    assert zero.get_data_types() == (torch.bfloat16, torch.float32)
    assert _engine({"bf16": {"enabled": True}}).communication_data_type == torch.bfloat16


def test_client_optimizer_name_and_momentum():
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.7),
                                       config={"train_batch_size": 2}, dist_init_required=False)
    assert engine.optimizer_name() == "SGD" and engine.get_mom() == [0.7]
    # a callable: DeepSpeed 0.19.8 answers the class of what was passed (`client_optimizer.__class__.__name__`)
    model = TinyMLP()
    engine, *_ = lightspeed.initialize(model=model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                       config={"train_batch_size": 2}, dist_init_required=False)
    assert engine.optimizer_name() == "function" and type(engine.optimizer).__name__ == "SGD"


def test_dataset_kinds():
    engine = _engine({})
    assert engine.is_map_style_dataset(torch.arange(3)) and not engine.is_map_style_dataset(iter([1]))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([1])

    assert engine.is_iterable_style_dataset(Stream()) and not engine.is_iterable_style_dataset([1])


def test_batch_setters_rewrite_the_batch_geometry_the_step_reads():
    from lightspeed.testing.models import regression_data

    engine = _engine({"gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.set_train_batch_size(8)  # micro batch 2 kept: 4 accumulation steps
    assert engine.get_batch_info() == (8, 2, 4) and engine.tput_timer.batch_size == 8
    x, y = regression_data(2)
    for micro in range(4):
        assert engine.is_gradient_accumulation_boundary() == (micro == 3)
        engine.backward(engine(x, y))
        engine.step()
    assert engine.global_steps == 1 and engine.global_samples == 8
    engine.set_train_micro_batch_size(3)  # accumulation kept: the global batch follows
    assert engine.get_batch_info() == (12, 3, 4) and engine.tput_timer.batch_size == 12
    for bad in (7, 0):
        with pytest.raises(ValueError, match="positive multiple of micro batch 3 x data parallel 1"):
            engine.set_train_batch_size(bad)
    with pytest.raises(ValueError, match="must be a positive integer"):
        engine.set_train_micro_batch_size(0)
    assert engine.get_batch_info() == (12, 3, 4)


def test_setting_getters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = _engine({"checkpoint": {"tag_validation": "Fail"},
                      "flops_profiler": {"enabled": True, "profile_step": 4, "module_depth": 2, "top_modules": 3},
                      "bf16": {"enabled": True}, "torch_autocast": {"enabled": False, "dtype": "bf16"}})
    assert engine.checkpoint_tag_validation_enabled() and engine.checkpoint_tag_validation_fail()
    assert not engine.use_node_local_storage() and engine.checkpoint_serialization_enabled()
    assert not engine.checkpoint_writer_enabled() and not engine.load_universal_checkpoint()
    assert engine.flops_profiler_enabled() and engine.flops_profiler_profile_step() == 4
    assert (engine.flops_profiler_module_depth(), engine.flops_profiler_top_modules()) == (2, 3)
    assert engine.flops_profiler_detailed() and engine.flops_profiler_output_file() is None
    assert not engine.autotuning_enabled() and not engine.autotuning_profile_model_info()
    assert engine.autotuning_metric_path() == str(tmp_path / "autotuning_metric.json")
    assert engine.autotuning_model_info_path() == str(tmp_path / "autotuning_model_info.json")
    assert engine.autotuning_metric() == "throughput" and engine.autotuning_start_profile_step() == 3
    assert not (engine.fp16_auto_cast() or engine.bf16_master_weights_and_gradients()
                or engine.bf16_optimizer_states() or engine.fp16_master_weights_and_gradients())
    assert not engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16
    assert not (engine.data_efficiency_enabled() or engine.data_sampling_enabled()
                or engine.curriculum_learning_enabled() or engine.random_ltd_enabled())
    assert engine.get_model_parallel_rank() == engine.get_tensor_parallel_rank() == 0
    assert not engine.is_first_weights_partition_group() and engine.managed_gradient_accumulation()
    assert engine.cpuadam_cores_perc() == 0.9 and not engine.super_offload()
    assert not engine.zero_nvme_offload_optimizer() and not engine.optimizer_legacy_fusion()
    assert engine.autotp_size() == 0 and engine.tensor_parallel_config() is engine.config.tensor_parallel
    for call in (engine.offload_states, engine.reload_states):
        with pytest.raises(NotImplementedError, match="moving the ZeRO states off the device"):
            call()
    with pytest.raises(NotImplementedError, match="manual backward"):
        engine.scale(torch.ones(()))
    with pytest.raises(NotImplementedError, match="one gradient reduction over several backward"):
        engine.coalesce_grad_reduction()
    quiet = _engine({"checkpoint": {"tag_validation": "IGNORE"}})
    assert not quiet.checkpoint_tag_validation_enabled() and quiet.torch_autocast_dtype() is None
    assert not quiet.flops_profiler_enabled()


def test_save_fp16_model_is_save_16bit_model(tmp_path):
    engine = _engine({})
    engine.save_fp16_model(str(tmp_path), "model.bin")
    state = torch.load(tmp_path / "model.bin")
    assert set(state) == set(engine.module.state_dict())


def test_load_checkpoint_refuses_custom_load_fn(tmp_path):
    engine = _engine({})
    with pytest.raises(NotImplementedError, match="custom_load_fn"):
        engine.load_checkpoint(str(tmp_path), custom_load_fn=lambda src, dst: None)
