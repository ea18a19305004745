"""DeepSpeed's engine accessors of the run's configuration and groups, read from lightspeed's config.

Owns the read-only `DeepSpeedEngine` getters scripts call on the engine (`engine.optimizer_name()`,
`engine.zero_offload_optimizer()`, `engine.communication_data_type`, `engine.get_batch_info()`, ...)
with DeepSpeed 0.19.8's answers (`EngineAccessors`: optimizer, batch, precision, communication,
ZeRO; `EngineSettingAccessors`: checkpoint, profiler, autotuning, data-efficiency sections and the
tensor-parallel ranks), DeepSpeed's two setters of the batch geometry, and the refusals of the engine
methods whose feature is not built (`offload_states`, `scale`, `coalesce_grad_reduction`). Must not: hold state of its own, or answer for a feature lightspeed does not build (such a
getter is absent, or raises NotImplementedError naming the feature).

Note: [config objects] the offload getters return lightspeed's config sections (`device`,
`nvme_path`, `pin_memory`, `ratio`, ... under DeepSpeed's field names), not DeepSpeed's pydantic
models; `None` where the config has no such section, as DeepSpeed's.

Note: [batch geometry] `set_train_batch_size` / `set_train_micro_batch_size` rewrite the batch sizes
in the engine's config, as DeepSpeed's rewrite its config: the step counters, the loss division by
`gradient_accumulation_steps` and the accumulation boundary read them at every step; the throughput
timer is told. A loader built earlier keeps its batch size (DeepSpeed's too). A new micro batch under
sequence parallelism is refused (Ulysses attention is built for one micro batch); the pipeline engine
sets the global batch its own way and refuses a new micro batch (pipe_engine.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lightspeed.precision.policy import parse_dtype


class EngineAccessors:
    """Mix into LightspeedEngine: needs `config`, `groups`, `policy`, `optimizer`, `fp16_enabled()`,
    `bfloat16_enabled()`, `train_batch_size()`, `train_micro_batch_size_per_gpu()`,
    `gradient_accumulation_steps()`, `dp_world_size`, `sequence_parallel_size` and `tput_timer`."""

    # the class name of a client optimizer (set by initialize); None when the config built it
    _client_optimizer_name: str | None = None

    # ------------------------------------------------------------------ optimizer and scheduler
    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's `optimizer.type` (lower-cased where it
        names one of DeepSpeed's optimizers, as DeepSpeed's config reads it); None without either."""
        if self._client_optimizer_name is not None:
            return self._client_optimizer_name
        return self.config.optimizer.name if self.config.optimizer is not None else None

    def optimizer_params(self) -> dict | None:
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict | None:
        return dict(self.config.scheduler.params) if self.config.scheduler is not None else None

    def _optimizer_param(self, key: str) -> list:
        # one entry per param group: the group's value, 0.0 where the group lacks the key (DeepSpeed's)
        if not self.optimizer:
            return []
        return [group.get(key, 0.0) for group in self.optimizer.param_groups]

    def get_mom(self) -> list:
        """Each param group's `momentum` (SGD, RMSprop) or `betas` (every other optimizer)."""
        return self._optimizer_param("momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas")

    def get_type(self) -> list:
        return self._optimizer_param("type")

    # ------------------------------------------------------------------ batch
    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """A new global batch size from the same micro batch: `gradient_accumulation_steps` becomes
        train_batch_size / (micro batch x dp); ValueError when that does not divide."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if not isinstance(train_batch_size, int) or train_batch_size <= 0 or train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size({train_batch_size!r}): must be a positive multiple of micro batch "
                             f"{self.train_micro_batch_size_per_gpu()} x data parallel {self.dp_world_size}")
        self._set_batch(train_batch_size, self.train_micro_batch_size_per_gpu(), train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """A new micro batch with the same `gradient_accumulation_steps` (the global batch follows). A
        loader already built keeps its batch size, as DeepSpeed's."""
        if not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size!r}): must be a positive integer")
        if self.sequence_parallel_size > 1:
            raise NotImplementedError("engine.set_train_micro_batch_size: changing the micro batch under sequence "
                                      "parallelism (its attention is built for the configured micro batch) is not "
                                      "implemented in lightspeed yet")
        gas = self.gradient_accumulation_steps()
        self._set_batch(micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas)

    def _set_batch(self, train_batch_size: int, micro_batch_size: int, gas: int) -> None:
        # the engine reads the batch sizes from its config at every step (DeepSpeed rewrites its config too)
        self.config.train_batch_size = train_batch_size
        self.config.train_micro_batch_size_per_gpu = micro_batch_size
        self.config.gradient_accumulation_steps = gas
        self.tput_timer.batch_size = train_batch_size

    def dataloader_drop_last(self) -> bool:
        return bool(self.config.dataloader_drop_last)

    @staticmethod
    def is_map_style_dataset(obj) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    # ------------------------------------------------------------------ precision and communication
    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return self.config.fp16.initial_dynamic_scale()

    def dynamic_loss_scale_args(self) -> dict:
        fp16 = self.config.fp16
        return {"init_scale": fp16.initial_dynamic_scale(), "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    @property
    def communication_data_type(self) -> torch.dtype:
        """`communication_data_type`, else the training precision's dtype (fp16, bf16, else fp32)."""
        configured = parse_dtype(self.config.communication_data_type, "communication_data_type")
        if configured is not None:
            return configured
        return torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else torch.float32

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the model's dtype, the gradient accumulation dtype): `data_types.grad_accum_dtype`, else the
        model's."""
        return self.policy.param_dtype, self.policy.grad_accum_dtype

    def gradient_predivide_factor(self) -> float:
        return self.config.gradient_predivide_factor

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.wall_clock_breakdown or self.config.flops_profiler.enabled)

    def log_level(self) -> str | None:
        """The config's `log_level` (None: the logger's level was left as it was)."""
        return self.config.log_level

    def dump_state(self) -> bool:
        return bool(self.config.dump_state)

    # ------------------------------------------------------------------ ZeRO
    def zero_optimization(self) -> bool:
        return self.config.zero_optimization.stage > 0

    def zero_offload_optimizer(self) -> Any:
        return self.config.zero_optimization.offload_optimizer

    def zero_offload_param(self) -> Any:
        return self.config.zero_optimization.offload_param

    def zero_cpu_offload(self) -> bool:
        off = self.config.zero_optimization.offload_optimizer
        return off is not None and off.device == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        off = self.config.zero_optimization.offload_optimizer
        return off is not None and off.device in ("cpu", "nvme")

    def zero_partial_offload(self) -> float:
        return getattr(self.config.zero_optimization.offload_optimizer, "ratio", 1.0)

    def zero_allow_untested_optimizer(self) -> bool:
        return bool(self.config.zero_allow_untested_optimizer)

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return bool(self.config.zero_force_ds_cpu_optimizer)

    def zero_nvme_offload_optimizer(self) -> bool:
        """Whether the optimizer state is swapped to NVMe (`offload_optimizer.device` "nvme")."""
        off = self.config.zero_optimization.offload_optimizer
        return off is not None and off.device == "nvme"

    def optimizer_legacy_fusion(self) -> bool:
        return bool(self.config.optimizer.legacy_fusion) if self.config.optimizer is not None else False

    # ------------------------------------------------------------------ DeepSpeed 0.19 methods not built
    def scale(self, loss):
        raise NotImplementedError("engine.scale: the manual backward (loss.backward() called outside "
                                  "engine.backward) is not implemented in lightspeed yet; call engine.backward(loss)")

    def coalesce_grad_reduction(self):
        raise NotImplementedError("engine.coalesce_grad_reduction: one gradient reduction over several backward "
                                  "calls is not implemented in lightspeed yet (engine.no_sync() defers the "
                                  "reduction without ZeRO stage 2/3)")

    def offload_states(self, include=None, device=None, pin_memory: bool = True, non_blocking: bool = False):
        raise NotImplementedError("engine.offload_states: moving the ZeRO states off the device between phases is "
                                  "not implemented in lightspeed yet")

    def reload_states(self, non_blocking: bool = False):
        raise NotImplementedError("engine.reload_states: moving the ZeRO states off the device between phases is "
                                  "not implemented in lightspeed yet")

    # ------------------------------------------------------------------ tensor parallelism
    def tensor_parallel_config(self) -> Any:
        """The `tensor_parallel` section (lightspeed's, under DeepSpeed's field names)."""
        return self.config.tensor_parallel

    def autotp_size(self) -> int:
        return self.config.tensor_parallel.autotp_size

    # ------------------------------------------------------------------ groups
    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank

    def get_sequence_parallel_group(self):
        return self.seq_parallel_group


class EngineSettingAccessors:
    """Mix into LightspeedEngine: DeepSpeed's getters of the checkpoint, profiler, autotuning, precision
    and data-efficiency sections, and its tensor-parallel ranks. Needs `config`, `groups` and
    `save_16bit_model`."""

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_tag_validation_enabled(self) -> bool:
        return str(self.config.checkpoint.tag_validation).upper() != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return str(self.config.checkpoint.tag_validation).upper() == "FAIL"

    def checkpoint_serialization_enabled(self) -> bool:
        return bool(self.config.checkpoint.checkpoint_serialization)

    def checkpoint_writer_enabled(self) -> bool:
        return self.config.checkpoint.writer is not None

    def use_node_local_storage(self) -> bool:
        return bool(self.config.checkpoint.use_node_local_storage)

    def load_universal_checkpoint(self) -> bool:
        return bool(self.config.checkpoint.load_universal)

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin"):
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    # ------------------------------------------------------------------ flops profiler and autotuning
    def autotuning_enabled(self) -> bool:
        return bool(self.config.autotuning.enabled)

    def autotuning_start_profile_step(self) -> int:
        return self.config.autotuning.start_profile_step

    def autotuning_end_profile_step(self) -> int:
        return self.config.autotuning.end_profile_step

    def autotuning_metric(self) -> str:
        return self.config.autotuning.metric

    def autotuning_metric_path(self) -> str:
        return self.config.autotuning.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")

    def autotuning_model_info_path(self) -> str:
        return self.config.autotuning.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json")

    def autotuning_profile_model_info(self) -> bool:
        info = self.config.autotuning.model_info
        return bool(self.autotuning_enabled() and info and info.get("profile", False))

    def flops_profiler_enabled(self) -> bool:
        return bool(self.config.flops_profiler.enabled or self.autotuning_enabled())

    def flops_profiler_profile_step(self) -> int:
        if self.autotuning_enabled():
            return self.autotuning_start_profile_step()
        return self.config.flops_profiler.profile_step

    def flops_profiler_recompute_fwd_factor(self) -> float:
        return self.config.flops_profiler.recompute_fwd_factor

    def flops_profiler_module_depth(self) -> int:
        return self.config.flops_profiler.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self.config.flops_profiler.top_modules

    def flops_profiler_detailed(self) -> bool:
        return False if self.autotuning_enabled() else bool(self.config.flops_profiler.detailed)

    def flops_profiler_output_file(self) -> str | None:
        return self.config.flops_profiler.output_file

    # ------------------------------------------------------------------ precision
    def fp16_auto_cast(self) -> bool:
        return bool(self.config.fp16.auto_cast)

    def fp16_master_weights_and_gradients(self) -> bool:
        return bool(self.config.fp16.fp16_master_weights_and_grads)

    def bf16_master_weights_and_gradients(self) -> bool:
        return bool(self.config.bf16.bf16_master_weights_and_grads)

    def bf16_optimizer_states(self) -> bool:
        return bool(self.config.bf16.bf16_optimizer_states)

    def torch_autocast_enabled(self) -> bool:
        return bool(self.config.torch_autocast.enabled)

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """`torch_autocast.dtype`; None when unset."""
        return parse_dtype(self.config.torch_autocast.dtype, "torch_autocast.dtype")

    # ------------------------------------------------------------------ ZeRO extras and data efficiency
    def is_sanity_checks_enabled(self) -> bool:
        return bool(self.config.zero_optimization.enable_sanity_checks)

    def is_first_weights_partition_group(self) -> bool:
        return self.zero_optimization_partition_weights()

    def cpuadam_cores_perc(self) -> float:
        return getattr(self.config.zero_optimization.offload_optimizer, "cpuadam_cores_perc", 0.9)

    def super_offload(self) -> bool:
        return bool(getattr(self.config.zero_optimization.offload_optimizer, "super_offload", False))

    def managed_gradient_accumulation(self) -> bool:
        return bool(self.config.managed_gradient_accumulation)

    def data_efficiency_enabled(self) -> bool:
        return bool(self.config.data_efficiency.enabled)

    def data_sampling_enabled(self) -> bool:
        return bool((self.config.data_efficiency.data_sampling or {}).get("enabled", False))

    def curriculum_learning_enabled(self) -> bool:
        sampling = self.config.data_efficiency.data_sampling or {}
        return bool((sampling.get("curriculum_learning") or {}).get("enabled", False))

    def random_ltd_enabled(self) -> bool:
        routing = self.config.data_efficiency.data_routing or {}
        return bool((routing.get("random_ltd") or {}).get("enabled", False))

    # ------------------------------------------------------------------ ranks
    def get_model_parallel_rank(self) -> int:
        """The tensor-parallel rank (DeepSpeed's model-parallel rank)."""
        return self.groups.tp_rank

    def get_tensor_parallel_rank(self) -> int:
        return self.groups.tp_rank


def _zero_getter(engine_name: str, field: str):
    def getter(self):
        return getattr(self.config.zero_optimization, field)

    getter.__name__ = getter.__qualname__ = engine_name
    getter.__doc__ = f"`zero_optimization.{field}`."
    return getter


# DeepSpeed's `engine.zero_<x>()` getters that read one zero_optimization field (engine name: field)
_ZERO_FIELDS = {
    "zero_allgather_partitions": "allgather_partitions", "zero_allgather_bucket_size": "allgather_bucket_size",
    "zero_reduce_scatter": "reduce_scatter", "zero_reduce_bucket_size": "reduce_bucket_size",
    "zero_overlap_comm": "overlap_comm", "zero_contiguous_gradients": "contiguous_gradients",
    "zero_sub_group_size": "sub_group_size", "zero_load_from_fp32_weights": "load_from_fp32_weights",
    "zero_elastic_checkpoint": "elastic_checkpoint", "zero_ignore_unused_parameters": "ignore_unused_parameters",
    "zero_round_robin_gradients": "round_robin_gradients", "zero_legacy_stage1": "legacy_stage1",
    "zero_compute_grad_norm": "compute_grad_norm", "zero_parameter_alignment": "parameter_alignment",
    "zero_max_live_parameters": "stage3_max_live_parameters", "zero_max_reuse_distance": "stage3_max_reuse_distance",
    "zero_prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "zero_param_persistence_threshold": "stage3_param_persistence_threshold",
    "zero_model_persistence_threshold": "stage3_model_persistence_threshold",
    "zero_module_granularity_threshold": "stage3_module_granularity_threshold",
    "zero_allgather_sequential": "stage3_allgather_sequential",
    "zero_multi_rank_bucket_allreduce": "use_multi_rank_bucket_allreduce",
    "zero_log_trace_cache_warnings": "log_trace_cache_warnings", "zero_hpz_partition_size": "zero_hpz_partition_size",
    "zero_quantized_weights": "zero_quantized_weights",
    "zero_quantized_nontrainable_weights": "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients": "zero_quantized_gradients",
    "zero_save_muon_momentum_buffer_in_memory": "save_muon_momentum_buffer_in_memory",
}
for _name, _field in _ZERO_FIELDS.items():
    setattr(EngineAccessors, _name, _zero_getter(_name, _field))
del _name, _field
