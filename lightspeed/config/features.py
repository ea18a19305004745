"""Engine feature sections: ``activation_checkpointing``, ``checkpoint``, ``aio``, ``pipeline``,
``elasticity``, ``autotuning`` and ``hybrid_engine``. Keys and defaults follow DeepSpeed's
``runtime/activation_checkpointing/config.py``, ``runtime/constants.py`` and
``runtime/model_checkpointing/constants.py``, ``runtime/swap_tensor/constants.py``,
``runtime/config.py`` (pipeline, hybrid engine), ``elasticity/constants.py`` and
``autotuning/constants.py``. Owns the section shapes only.

`autotuning.arg_mappings` / `model_info` stay free dicts: they are read by the autotuner, not the
engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import BeforeValidator

from lightspeed.config.base import (
    Bool, Choice, Float, FreeDict, IntList, NonNegInt, PosInt, Section, Str, as_int, expectation,
)  # fmt: skip


class ActivationCheckpointingConfig(Section):
    """``activation_checkpointing``: options of ``deepspeed.checkpointing`` (Megatron-style)."""

    partition_activations: Bool = False
    contiguous_memory_optimization: Bool = False
    cpu_checkpointing: Bool = False
    number_checkpoints: Optional[PosInt] = None
    synchronize_checkpoint_boundary: Bool = False
    profile: Bool = False


WriterType = Choice("MOCK", "PYTHON", "FAST", normalize=str.upper)
WriterDataParallel = Choice("REPLICA", "SOCKET", "MACHINE", normalize=str.upper)
SnapshotPool = Choice("first_save", "startup", normalize=str.lower)
CheckpointFormat = Choice("lightspeed", "deepspeed", normalize=str.lower)
TunerType = Choice("gridsearch", "random", "model_based")


class ParallelWriteConfig(Section):
    """``checkpoint.parallel_write``."""

    pipeline_stage: Bool = False


class CheckpointWriterConfig(Section):
    """``checkpoint.writer``: DeepSpeed's fast/decoupled checkpoint writers."""

    type: WriterType = "FAST"
    decoupled: Bool = False
    io_buffer_size: PosInt = 64 * 1024**2
    io_buffer_double: Bool = True
    show_statistics: Bool = False
    data_parallel: Optional[WriterDataParallel] = None
    io_multiplier: PosInt = 1
    snapshot_pool: SnapshotPool = "first_save"
    """lightspeed's own key: when a decoupled writer allocates the host memory it snapshots the state
    into (kept for every later save): at the first save ("first_save"), or when the engine is built
    and again after the first optimizer step, which creates the optimizer state ("startup"), so that
    no save allocates."""


TagValidation = Choice("WARN", "IGNORE", "FAIL", normalize=str.upper, what='must be "Warn", "Ignore" or "Fail"')


class CheckpointConfig(Section):
    """``checkpoint``."""

    tag_validation: TagValidation = "WARN"
    """Check that every rank saves/loads the same tag: WARN, IGNORE or FAIL (case-insensitive)."""
    load_universal: Bool = False
    use_node_local_storage: Bool = False
    parallel_write: ParallelWriteConfig = ParallelWriteConfig()
    checkpoint_serialization: Bool = True
    writer: Optional[CheckpointWriterConfig] = None
    format: CheckpointFormat = "lightspeed"
    """lightspeed's own key: the layout ``save_checkpoint`` writes. "deepspeed": DeepSpeed 0.19.8's files
    (lightspeed's tag written, then converted in place by rank 0: checkpoint/deepspeed_writer.py), which
    DeepSpeed's ``load_checkpoint`` resumes at the same ZeRO stage and data-parallel world size (with
    DeepSpeed-style MoE experts: ZeRO 0-2, checkpoint/deepspeed_moe_writer.py)."""


class AIOConfig(Section):
    """``aio``: the asynchronous NVMe I/O used by ZeRO-Infinity offload."""

    block_size: PosInt = 1_048_576
    queue_depth: PosInt = 8
    intra_op_parallelism: PosInt = 1
    thread_count: PosInt = 1
    """DeepSpeed's older name for intra_op_parallelism (used when intra_op_parallelism is not given)."""
    single_submit: Bool = False
    overlap_events: Bool = True
    use_gds: Bool = False


def _check_stages(value: Any):
    if value == "auto":
        return value
    count = as_int(value)
    if count is None or count < 1:
        raise expectation('must be "auto" or a positive integer')
    return count


PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble")


class PipelineConfig(Section):
    """``pipeline``: options of the pipeline engine (``PipelineModule`` training). DeepSpeed's keys, and
    lightspeed's own ``schedule`` (torch.distributed.pipelining's schedule behind ``train_batch``:
    "1f1b", DeepSpeed's, by default) and ``virtual_stages`` (stages per pipeline rank: 1 for "1f1b" and
    "gpipe", 2 by default and at least 2 for the interleaved ones, exactly 2 for "zbv_zero_bubble").
    DeepSpeed's ``stages`` and ``partition`` are not read by its engine either (the ``PipelineModule``'s
    ``num_stages`` and ``partition_method`` decide); ``pipe_partitioned`` / ``grad_partitioned``
    (activations split over tensor-parallel ranks in transit) change no result: lightspeed sends them whole."""

    stages: Annotated[Any, BeforeValidator(_check_stages)] = "auto"
    partition: Str = "best"
    seed_layers: Bool = False
    activation_checkpoint_interval: NonNegInt = 0
    pipe_partitioned: Bool = True
    grad_partitioned: Bool = True
    schedule: Choice(*PIPELINE_SCHEDULES, normalize=str.lower) = "1f1b"
    virtual_stages: Optional[PosInt] = None

    def stages_per_rank(self) -> int:
        """`virtual_stages`, or its default for the schedule; ValueError when the schedule cannot use it."""
        multi = self.schedule in MULTI_STAGE_SCHEDULES
        v = self.virtual_stages if self.virtual_stages is not None else (2 if multi else 1)
        if not multi and v != 1:
            raise ValueError(f"pipeline.virtual_stages: the {self.schedule!r} schedule runs one stage per rank "
                             f"(got {v}); use interleaved_1f1b, interleaved_zero_bubble or zbv_zero_bubble")
        if self.schedule == "zbv_zero_bubble" and v != 2:
            raise ValueError(f"pipeline.virtual_stages: zbv_zero_bubble runs two stages per rank (got {v})")
        if multi and v < 2:
            raise ValueError(f"pipeline.virtual_stages: {self.schedule} needs at least 2 stages per rank (got {v})")
        return v


class ElasticityConfig(Section):
    """``elasticity``: pick a batch size that works for a range of GPU counts (config/elasticity.py)."""

    enabled: Bool = False
    max_train_batch_size: PosInt = 2000
    micro_batch_sizes: IntList(ge=1) = [2, 4, 6]
    min_gpus: PosInt = 1
    max_gpus: PosInt = 10000
    min_time: NonNegInt = 0
    prefer_larger_batch: Bool = True
    ignore_non_elastic_batch_info: Bool = False
    version: Float(gt=0) = 0.2
    model_parallel_size: PosInt = 1
    num_gpus_per_node: PosInt = 1


class AutotuningConfig(Section):
    """``autotuning``: DeepSpeed's autotuner (driven by the launcher, lightspeed/autotuning; with ``enabled``
    the engine measures the profile window and exits, runtime/autotuning_probe.py)."""

    enabled: Bool = False
    fast: Bool = True
    results_dir: Str = "autotuning_results"
    exps_dir: Str = "autotuning_exps"
    overwrite: Bool = True
    start_profile_step: NonNegInt = 3
    end_profile_step: NonNegInt = 5
    metric: Str = "throughput"
    metric_path: Optional[Str] = None
    tuner_type: TunerType = "gridsearch"
    tuner_early_stopping: NonNegInt = 5
    tuner_num_trials: PosInt = 50
    arg_mappings: Optional[FreeDict] = None
    model_info: Optional[FreeDict] = None
    model_info_path: Optional[Str] = None
    mp_size: PosInt = 1
    max_train_batch_size: Optional[PosInt] = None
    min_train_batch_size: PosInt = 1
    max_train_micro_batch_size_per_gpu: PosInt = 1024
    min_train_micro_batch_size_per_gpu: PosInt = 1
    num_tuning_micro_batch_sizes: PosInt = 3
    # lightspeed's own key: bytes per rank above which a candidate is pruned unrun (default: the accelerator's)
    memory_budget: Optional[PosInt] = None


class HybridEngineConfig(Section):
    """``hybrid_engine``: one engine that trains and generates (RLHF actors; built by ``lightspeed.hybrid``)."""

    enabled: Bool = False
    max_out_tokens: PosInt = 512
    inference_tp_size: PosInt = 1
    release_inference_cache: Bool = False
    pin_parameters: Bool = True
    tp_gather_partition_size: PosInt = 8
    enable_cuda_graph: Bool = False


def feature_problems(cfg) -> list[str]:
    """Rules across keys of these sections."""
    out = []
    ac = cfg.activation_checkpointing  # DeepSpeed asserts these in deepspeed.checkpointing.configure
    if ac.contiguous_memory_optimization and not ac.partition_activations:
        out.append("activation_checkpointing.contiguous_memory_optimization: needs "
                   "activation_checkpointing.partition_activations true (it lays out the partitions)")
    if ac.contiguous_memory_optimization and not ac.number_checkpoints:
        out.append("activation_checkpointing.contiguous_memory_optimization: needs "
                   "activation_checkpointing.number_checkpoints (the buffers hold that many checkpoints)")
    at = cfg.autotuning
    if at.end_profile_step < at.start_profile_step:
        out.append(
            f"autotuning.end_profile_step: must be >= autotuning.start_profile_step "
            f"({at.start_profile_step}) (got {at.end_profile_step})"
        )
    he = cfg.hybrid_engine
    if he.enabled and he.enable_cuda_graph and not he.pin_parameters and cfg.zero_optimization.stage == 3:
        out.append("hybrid_engine.enable_cuda_graph: needs hybrid_engine.pin_parameters true at zero_optimization."
                   "stage 3 (layer-by-layer gathers inside each decode step cannot be captured in a CUDA graph)")
    el = cfg.elasticity
    if el.max_gpus < el.min_gpus:
        out.append(f"elasticity.max_gpus: must be >= elasticity.min_gpus ({el.min_gpus}) (got {el.max_gpus})")
    return out


__all__ = [
    "AIOConfig", "ActivationCheckpointingConfig", "AutotuningConfig", "CheckpointConfig",
    "CheckpointWriterConfig", "ElasticityConfig", "HybridEngineConfig", "PipelineConfig",
    "feature_problems",
]  # fmt: skip
