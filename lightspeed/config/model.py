"""`LightspeedConfig`: the whole ds_config as one validated object, and the rules that span sections.

Every top-level key DeepSpeed reads for training is a field named exactly as the key, with
DeepSpeed's default. After `config.load()` the batch triad holds ints. Sections too large and too
rarely used to model (``nebula``, ...) are kept as free
dicts. This module must not read files or touch the environment: that is `loader.py`'s job.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Optional

from pydantic import BeforeValidator, PrivateAttr

from lightspeed.config.base import Bool, Choice, Flag, Float, FreeDict, PosInt, Section, as_int, expectation
from lightspeed.config.comm import CommConfig
from lightspeed.config.compiler import CompileConfig, Float8Config
from lightspeed.config.kernels import KernelsConfig
from lightspeed.config.efficiency import (
    CompressionTrainingConfig, CurriculumLearningConfig, DataEfficiencyConfig, EigenvalueConfig,
    ProgressiveLayerDropConfig, SparseAttentionConfig,
)  # fmt: skip
from lightspeed.config.features import (
    AIOConfig, ActivationCheckpointingConfig, AutotuningConfig, CheckpointConfig, ElasticityConfig,
    HybridEngineConfig, PipelineConfig, feature_problems,
)  # fmt: skip
from lightspeed.config.monitoring import (
    CometConfig, CommsLoggerConfig, CSVMonitorConfig, FlopsProfilerConfig, TensorBoardConfig, TimersConfig,
    TrackioConfig, WandbConfig,
)  # fmt: skip
from lightspeed.config.optimizer import OptimizerConfig, SchedulerConfig
from lightspeed.config.precision import AMPConfig, BF16Config, DataTypesConfig, FP16Config, TorchAutocastConfig
from lightspeed.config.expert_parallel import ExpertParallelConfig
from lightspeed.config.tensor_parallel import TensorParallelConfig
from lightspeed.config.zero import ZeroConfig, zero_problems

CommDtype = Choice("fp16", "bf16", "fp32", normalize=str.lower)
AllreduceOp = Choice("mean", "sum", normalize=str.lower)
LogLevel = Choice("debug", "info", "warning", "error", "critical", normalize=str.lower)


def _check_steps_per_print(value):
    # accelerate writes float("inf") to silence DeepSpeed's step log; null means the same to DeepSpeed
    if value is None or (isinstance(value, float) and math.isinf(value) and value > 0):
        return None
    number = as_int(value)
    if number is None or number < 1:
        raise expectation("must be a positive integer")
    return number


StepsPerPrint = Annotated[Optional[int], BeforeValidator(_check_steps_per_print)]


class LightspeedConfig(Section):
    """A validated ds_config. Build it with `lightspeed.config.load`, which also resolves the batch
    triad and keeps the parsed input on `raw`."""

    # Batch size (resolved by load(): ints afterwards)
    train_batch_size: Optional[PosInt] = None
    train_micro_batch_size_per_gpu: Optional[PosInt] = None
    gradient_accumulation_steps: Optional[PosInt] = None
    managed_gradient_accumulation: Bool = True

    # Logging
    steps_per_print: StepsPerPrint = None
    """Log every N steps; null (DeepSpeed's default since 0.16) or Infinity (accelerate's setting): never."""
    wall_clock_breakdown: Bool = False
    memory_breakdown: Bool = False
    dump_state: Bool = False

    # Gradients and communication
    gradient_clipping: Float(ge=0) = 1.0
    prescale_gradients: Bool = False
    gradient_predivide_factor: Float(gt=0) = 1.0
    gradient_allreduce_op: AllreduceOp = "mean"
    sparse_gradients: Bool = False
    disable_allgather: Bool = False
    communication_data_type: Optional[CommDtype] = None
    """None lets the precision mode decide (DeepSpeed's default)."""
    seq_parallel_communication_data_type: CommDtype = "fp32"
    sequence_parallel_size: Optional[PosInt] = None

    # Optimizer
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    zero_allow_untested_optimizer: Flag = False
    zero_force_ds_cpu_optimizer: Bool = True

    # Precision
    fp16: FP16Config = FP16Config()
    bf16: BF16Config = BF16Config()
    amp: AMPConfig = AMPConfig()
    torch_autocast: TorchAutocastConfig = TorchAutocastConfig()
    data_types: DataTypesConfig = DataTypesConfig()

    # ZeRO and features
    zero_optimization: ZeroConfig = ZeroConfig()
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    aio: AIOConfig = AIOConfig()
    pipeline: PipelineConfig = PipelineConfig()
    elasticity: ElasticityConfig = ElasticityConfig()
    autotuning: AutotuningConfig = AutotuningConfig()
    hybrid_engine: HybridEngineConfig = HybridEngineConfig()

    # Monitoring and profiling
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()
    tensorboard: TensorBoardConfig = TensorBoardConfig()
    wandb: WandbConfig = WandbConfig()
    csv_monitor: CSVMonitorConfig = CSVMonitorConfig()
    comet: CometConfig = CometConfig()
    trackio: TrackioConfig = TrackioConfig()
    comms_logger: CommsLoggerConfig = CommsLoggerConfig()
    comm: CommConfig = CommConfig()  # lightspeed's own: timeouts (config/comm.py)
    timers: TimersConfig = TimersConfig()

    # Training-efficiency research features
    compression_training: CompressionTrainingConfig = CompressionTrainingConfig()
    data_efficiency: DataEfficiencyConfig = DataEfficiencyConfig()
    curriculum_learning: CurriculumLearningConfig = CurriculumLearningConfig()
    progressive_layer_drop: ProgressiveLayerDropConfig = ProgressiveLayerDropConfig()
    sparse_attention: Optional[SparseAttentionConfig] = None
    eigenvalue: EigenvalueConfig = EigenvalueConfig()

    # Misc top-level switches DeepSpeed reads
    vocabulary_size: Optional[PosInt] = None
    dataloader_drop_last: Bool = False
    graph_harvesting: Bool = False
    use_data_before_expert_parallelism: Bool = False
    disable_python_gc: Bool = False
    log_level: Optional[LogLevel] = None
    """DeepSpeed's engine log level (0.19.8): initialize() sets the lightspeed logger to it; None leaves it."""

    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    expert_parallel: ExpertParallelConfig = ExpertParallelConfig()  # AutoEP (parallel/experts/autoep.py)

    # Compiler and float8 training (lightspeed's own section: DeepSpeed has none)
    compile: CompileConfig = CompileConfig()
    float8: Float8Config = Float8Config()
    kernels: KernelsConfig = KernelsConfig()  # lightspeed's own: fused training kernels (config/kernels.py)

    # Sections kept as free dicts (large, fast-moving schemas nothing here consumes yet)
    nebula: FreeDict = {}
    datastates: FreeDict = {}
    quantize_training: FreeDict = {}
    weight_quantization: Optional[FreeDict] = None

    _raw: dict = PrivateAttr(default_factory=dict)
    _world_size: Optional[int] = PrivateAttr(default=None)
    _world_size_source: str = PrivateAttr(default="")
    _source: str = PrivateAttr(default="<dict>")

    @property
    def raw(self) -> dict:
        """The parsed input after legacy-name mapping (unknown top-level keys included)."""
        return self._raw

    @property
    def world_size(self) -> Optional[int]:
        """The data-parallel world size the batch triad was resolved with."""
        return self._world_size

    @property
    def world_size_source(self) -> str:
        """Where `world_size` came from (argument, torch.distributed, env WORLD_SIZE or default)."""
        return self._world_size_source

    @property
    def source(self) -> str:
        """The file the config was read from, or ``<dict>`` / ``<string>``."""
        return self._source

    @property
    def zero_enabled(self) -> bool:
        return self.zero_optimization.stage > 0

    def to_dict(self) -> dict[str, Any]:
        """Every key with defaults filled in, as JSON-ready values (for ``lightspeed config show``)."""
        return self.model_dump(mode="json")

    def get(self, key: str, default: Any = None) -> Any:
        """`raw.get(key, default)`: a top-level key of the config as the caller wrote it. DeepSpeed's
        `engine.config` is that dict, and callers read it so (the HF Trainer:
        ``engine.config.get("zero_optimization", {}).get("stage")``)."""
        return self._raw.get(key, default)


def cross_problems(cfg: LightspeedConfig) -> list[str]:
    """Rules that span sections, in DeepSpeed's meaning (its asserts in DeepSpeedConfig), worded
    as config problems."""
    out = []
    fp16, bf16, stage = cfg.fp16, cfg.bf16, cfg.zero_optimization.stage
    if fp16.enabled and bf16.enabled:
        out.append("fp16.enabled, bf16.enabled: fp16 and bf16 cannot both be enabled (got both true)")
    if fp16.enabled and fp16.dynamic:
        for key in ("loss_scale_window", "hysteresis", "min_loss_scale"):
            value = getattr(fp16, key)
            if value <= 0:
                out.append(f"fp16.{key}: must be > 0 with dynamic loss scaling (loss_scale 0) (got {value})")
    if fp16.fp16_master_weights_and_grads and stage == 0:
        out.append("fp16.fp16_master_weights_and_grads: needs zero_optimization.stage 1, 2 or 3 (got stage 0)")
    if bf16.bf16_master_weights_and_grads and stage == 0:
        out.append("bf16.bf16_master_weights_and_grads: needs zero_optimization.stage 1, 2 or 3 (got stage 0)")
    if bf16.bf16_optimizer_states:
        if stage == 0:
            out.append("bf16.bf16_optimizer_states: needs zero_optimization.stage 1, 2 or 3 (got stage 0)")
        if not bf16.bf16_master_weights_and_grads:
            out.append("bf16.bf16_optimizer_states: needs bf16.bf16_master_weights_and_grads true (got false)")
    if bf16.stochastic_rounding and not bf16.bf16_master_weights_and_grads:
        out.append("bf16.stochastic_rounding: rounds the bf16 master weights and optimizer states, so it needs "
                   "bf16.bf16_master_weights_and_grads true (got false)")
    if not cfg.managed_gradient_accumulation and stage < 2 and cfg.zero_optimization.overlap_comm:  # DeepSpeed's rule
        out.append("managed_gradient_accumulation: false supports zero_optimization.overlap_comm only with ZeRO "
                   f"stage 2 or 3 (got stage {stage} with overlap_comm true)")
    if cfg.gradient_allreduce_op == "sum" and stage == 3:  # DeepSpeedConfig's rule
        out.append('gradient_allreduce_op: "sum" is not supported with zero_optimization.stage 3 (got "sum")')
    out += zero_problems(cfg.zero_optimization)
    out += feature_problems(cfg)
    return out
