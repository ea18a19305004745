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
