"""`deepspeed.runtime.config`: `DeepSpeedConfig`, DeepSpeed's parsed-config object, as an adapter over
`lightspeed.config.load` (the validation, defaults and batch-triad resolution are lightspeed's), with
the attribute names DeepSpeed's object has and its callers read, and the optimizer-name constants of
DeepSpeed's runtime/config.py (release 0.18.2's set)."""

from __future__ import annotations

from lightspeed import config as _config
from lightspeed.config import batch as _batch
from lightspeed.compat.deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from lightspeed.compat.deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from lightspeed.config.efficiency import SparseAttentionConfig as _SparseAttentionConfig
from lightspeed.config.errors import ConfigError as DeepSpeedConfigError

# DeepSpeed's names for the optimizers it builds from a config's `optimizer.type` (lowercased), as in
# its runtime/config.py; lightspeed/optim/factory.py builds them.
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"
DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER, ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER, ONEBIT_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER,
    ZERO_ONE_ADAM_OPTIMIZER, MUADAM_OPTIMIZER, MUADAMW_OPTIMIZER, MUSGD_OPTIMIZER, LION_OPTIMIZER, MUON_OPTIMIZER,
]
TORCH_ADAM_PARAM = "torch_adam"  # optimizer.params key: torch.optim.Adam(W) instead of the fused kernel
ADAM_W_MODE = "adam_w_mode"  # optimizer.params key of "Adam": decoupled weight decay (AdamW)
ADAM_W_MODE_DEFAULT = True
GRADIENT_ALLREDUCE_OP_MEAN = "mean"  # lightspeed averages gradients over the data-parallel ranks (zero/reduce.py)


def get_sparse_attention(param_dict: dict):
    """DeepSpeed's parser of the `sparse_attention` section: its per-mode dict (mode, block and that
    mode's keys, defaults filled in), or None when `param_dict` has no such section."""
    if "sparse_attention" not in param_dict:
        return None
    return _SparseAttentionConfig.model_validate(param_dict["sparse_attention"]).deepspeed_dict()


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
        self.elasticity_enabled = cfg.elasticity.enabled  # the triad above is then the elastic one
        if self.elasticity_enabled:
            self.elastic_model_parallel_size = cfg.elasticity.model_parallel_size
            self.num_gpus_per_node = cfg.elasticity.num_gpus_per_node

        self.gradient_clipping = cfg.gradient_clipping
        self.prescale_gradients = cfg.prescale_gradients
        self.gradient_predivide_factor = cfg.gradient_predivide_factor
        self.sparse_gradients_enabled = cfg.sparse_gradients
        self.disable_allgather = cfg.disable_allgather
        self.communication_data_type = cfg.communication_data_type
        # data_types, as DeepSpeed 0.19.8 holds them: raw names ("bf16", ...) or None; "auto" or patterns
        self.grad_accum_dtype = cfg.data_types.grad_accum_dtype
        self.param_dtype = cfg.data_types.param_dtype
        self.buffer_dtype = cfg.data_types.buffer_dtype
        self.keep_in_fp32_modules = cfg.data_types.keep_in_fp32_modules

        # DeepSpeed's model of the section, with its field names (`prefetch_bucket_size` for
        # `stage3_prefetch_bucket_size`, ...), over the section lightspeed validated
        self.zero_config = DeepSpeedZeroConfig.model_validate(cfg.zero_optimization.model_dump())
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = cfg.zero_optimization.stage > 0
        self.zero_allow_untested_optimizer = cfg.zero_allow_untested_optimizer
        self.zero_force_ds_cpu_optimizer = cfg.zero_force_ds_cpu_optimizer

        self.float16_config = DeepSpeedFP16Config.model_validate(cfg.fp16.model_dump())
        self.bfloat16_config = DeepSpeedBF16Config.model_validate(cfg.bf16.model_dump())
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
        # DeepSpeed's per-mode dict of the section (None when absent); models build their layout from it
        self.sparse_attention = cfg.sparse_attention.deepspeed_dict() if cfg.sparse_attention is not None else None

    def _configure_train_batch_size(self) -> None:
        """DeepSpeed's re-derivation of the batch triad from the three attributes as they are now (None:
        not given), with lightspeed's rules; an inconsistent or underdetermined triad is an
        AssertionError (DeepSpeed asserts), leaving the attributes as they were."""
        train, micro, gas, problems = _batch.resolve_batch(
            self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps,
            self.world_size, "DeepSpeedConfig")
        if problems:
            raise AssertionError("; ".join(problems))
        self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps = train, micro, gas

    @property
    def gradient_allreduce_op(self) -> str:
        """DeepSpeed's `gradient_allreduce_op`: how gradients are combined over the data-parallel ranks,
        "mean" (the default) or "sum"; read from the config (read-only here)."""
        return self.ls_config.gradient_allreduce_op

    def __repr__(self) -> str:
        return (f"DeepSpeedConfig(train_batch_size={self.train_batch_size}, zero_optimization_stage="
                f"{self.zero_optimization_stage}, fp16={self.fp16_enabled}, bf16={self.bfloat16_enabled})")


__all__ = ["ADAGRAD_OPTIMIZER", "ADAMW_OPTIMIZER", "ADAM_OPTIMIZER", "ADAM_W_MODE", "ADAM_W_MODE_DEFAULT",
           "DEEPSPEED_OPTIMIZERS", "DeepSpeedConfig", "DeepSpeedConfigError", "LAMB_OPTIMIZER", "LION_OPTIMIZER",
           "MUADAMW_OPTIMIZER", "MUADAM_OPTIMIZER", "MUON_OPTIMIZER", "MUSGD_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER",
           "ONEBIT_LAMB_OPTIMIZER", "TORCH_ADAM_PARAM", "ZERO_ONE_ADAM_OPTIMIZER", "get_sparse_attention"]
