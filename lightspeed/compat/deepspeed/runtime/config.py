"""`deepspeed.runtime.config`: `DeepSpeedConfig`, DeepSpeed's parsed-config object, as an adapter over
`lightspeed.config.load` (the validation, defaults and batch-triad resolution are lightspeed's), with
the attribute names DeepSpeed's object has and its callers read."""

from __future__ import annotations

from lightspeed import config as _config
from lightspeed.config.errors import ConfigError as DeepSpeedConfigError


class DeepSpeedConfig:
    """`DeepSpeedConfig(config, mpu=None, mesh_device=None)`: `config` a dict or a JSON/HJSON path.

    The data-parallel world size for the batch triad is `mpu.get_data_parallel_world_size()` when an
    mpu is given, else lightspeed's rule (torch.distributed, then $WORLD_SIZE, then 1). The validated
    `LightspeedConfig` is `ls_config`; `_param_dict` is the parsed input, as DeepSpeed keeps it.
    """

    def __init__(self, config, mpu=None, mesh_device=None):
        if mesh_device is not None:
            raise NotImplementedError("DeepSpeedConfig(mesh_device=...): device meshes (sequence / tensor "
                                      "parallelism) are not implemented in lightspeed yet")
        world_size = mpu.get_data_parallel_world_size() if mpu is not None else None
        cfg = _config.load(config, world_size=world_size)
        self.ls_config = cfg
        self._param_dict = cfg.raw
        self.world_size = cfg.world_size

        self.train_batch_size = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.steps_per_print = cfg.steps_per_print
        self.dump_state = cfg.dump_state
        self.wall_clock_breakdown = cfg.wall_clock_breakdown
        self.memory_breakdown = cfg.memory_breakdown

        self.gradient_clipping = cfg.gradient_clipping
        self.prescale_gradients = cfg.prescale_gradients
        self.gradient_predivide_factor = cfg.gradient_predivide_factor
        self.sparse_gradients_enabled = cfg.sparse_gradients
        self.disable_allgather = cfg.disable_allgather
        self.communication_data_type = cfg.communication_data_type

        self.zero_config = cfg.zero_optimization
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = cfg.zero_optimization.stage > 0
        self.zero_allow_untested_optimizer = cfg.zero_allow_untested_optimizer
        self.zero_force_ds_cpu_optimizer = cfg.zero_force_ds_cpu_optimizer

        self.fp16_enabled = cfg.fp16.enabled
        self.fp16_auto_cast = cfg.fp16.auto_cast
        self.fp16_master_weights_and_gradients = cfg.fp16.fp16_master_weights_and_grads
        self.bfloat16_enabled = cfg.bf16.enabled
        self.amp_enabled = cfg.amp.enabled
        self.amp_params = cfg.amp.params() if cfg.amp.enabled else False
        self.loss_scale = cfg.fp16.loss_scale
        self.initial_dynamic_scale = cfg.fp16.initial_dynamic_scale()
        self.dynamic_loss_scale_args = None
        if cfg.fp16.enabled and cfg.fp16.dynamic:
            self.dynamic_loss_scale_args = {
                "init_scale": cfg.fp16.initial_dynamic_scale(), "scale_window": cfg.fp16.loss_scale_window,
                "delayed_shift": cfg.fp16.hysteresis, "consecutive_hysteresis": cfg.fp16.consecutive_hysteresis,
                "min_scale": cfg.fp16.min_loss_scale,
            }

        self.optimizer_name = cfg.optimizer.name if cfg.optimizer is not None else None
        self.optimizer_params = dict(cfg.optimizer.params) if cfg.optimizer is not None else None
        self.optimizer_legacy_fusion = cfg.optimizer.legacy_fusion if cfg.optimizer is not None else False
        self.scheduler_name = cfg.scheduler.type if cfg.scheduler is not None else None
        self.scheduler_params = dict(cfg.scheduler.params) if cfg.scheduler is not None else None

        self.activation_checkpointing_config = cfg.activation_checkpointing
        self.checkpoint_config = cfg.checkpoint
        self.elasticity_enabled = bool(cfg.elasticity.enabled)
        self.dataloader_drop_last = cfg.dataloader_drop_last

    def __repr__(self) -> str:
        return (f"DeepSpeedConfig(train_batch_size={self.train_batch_size}, zero_optimization_stage="
                f"{self.zero_optimization_stage}, fp16={self.fp16_enabled}, bf16={self.bfloat16_enabled})")


__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]
