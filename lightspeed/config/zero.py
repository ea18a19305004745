"""The ``zero_optimization`` section with its ``offload_optimizer`` / ``offload_param`` blocks,
ZeRO++ keys (``zero_quantized_weights``, ``zero_hpz_partition_size``, ``zero_quantized_gradients``,
...) and MiCS keys. Keys and defaults follow DeepSpeed's ``runtime/zero/config.py`` and
``runtime/zero/offload_config.py``.

Attributes carry the JSON names, so the stage-3 knobs are ``stage3_prefetch_bucket_size`` and so
on. DeepSpeed also accepts their unprefixed field names (``prefetch_bucket_size``); `legacy.py`
rewrites those, and the deprecated ``cpu_offload*`` / ``stage3_gather_fp16_weights_on_model_save``
keys, before this model sees the dict. Owns the section's shape only; no partitioning logic.
"""

from __future__ import annotations

import sys
from typing import Optional

from pydantic import field_validator, model_validator

from lightspeed.config.base import Bool, Choice, Float, FreeDict, Int, NonNegInt, Section, Str, StrList

OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# DeepSpeed's field name -> JSON alias, for the stage-3 knobs that have a `stage3_` alias.
STAGE3_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}

OffloadDevice = Choice(*OFFLOAD_DEVICES)
SuperOffloadRollback = Choice("inverse", "copy")
Stage = Int(ge=0, le=3, what="must be 0, 1, 2 or 3")


class OffloadParamConfig(Section):
    """``zero_optimization.offload_param``: where stage-3 parameter partitions live."""

    device: OffloadDevice = "none"
    nvme_path: Optional[Str] = None
    nvme_path_per_local_rank: Optional[StrList] = None
    """lightspeed's own key (DeepSpeed 0.19.8 has none): one NVMe path per local rank, indexed by
    LOCAL_RANK."""
    buffer_count: NonNegInt = 5
    buffer_size: NonNegInt = 100_000_000
    max_in_cpu: NonNegInt = 1_000_000_000
    """Parameter elements kept in CPU memory when offloading to NVMe."""
    pin_memory: Bool = True
    """Page-locked host memory for the offloaded partitions (DeepSpeed's default since 0.19.4)."""


class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer``: where optimizer state lives and where the step runs."""

    device: OffloadDevice = "none"
    nvme_path: Optional[Str] = None
    nvme_path_per_local_rank: Optional[StrList] = None
    """lightspeed's own key, as offload_param's."""
    buffer_count: NonNegInt = 4
    pin_memory: Bool = True
    """Page-locked host memory for the offloaded optimizer state (DeepSpeed's default since 0.19.4)."""
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    fast_init: Bool = False
    ratio: Float(ge=0.0, le=1.0) = 1.0
    """Fraction of the optimizer step run on CPU (partial offload; ZeRO-3 only)."""
    super_offload: Bool = False
    super_offload_rollback: Optional[SuperOffloadRollback] = None
    """lightspeed's own key: how `super_offload`'s speculative step is rolled back when the step clips or
    overflows. "inverse" (DeepSpeed's way): the Adam/AdamW step is undone algebraically from its gradient,
    no copies, close to the synchronous step (offload/speculative.py's Note); "copy": each range's master and optimizer
    state are copied before it steps, bitwise the synchronous step, at one host copy of the optimizer state
    and its copy time per step. Unset: "inverse" where the optimizer has an inverse (fp32 Adam/AdamW),
    else "copy"."""
    cpuadam_cores_perc: Float(ge=0.0, le=1.0) = 0.8
    overlap_step: Bool = False
    """lightspeed's own key (off by default): run the CPU optimizer step in the background during the next
    forward and backward, so parameters lag one step behind the gradients (the ZeRO-Offload paper's
    delayed parameter update; ZenFlow's `overlap_step` names the same idea)."""
    overlap_step_warmup: NonNegInt = 0
    """lightspeed's own key: with `overlap_step`, the number of first steps run synchronously before the
    delayed update begins (the delay costs most while the parameters move fastest)."""

    @property
    def pipeline(self) -> bool:
        return self.pipeline_read or self.pipeline_write


# DeepSpeed 0.18's default leaf classes: Hugging Face's sparse MoE blocks, whose experts a step may not
# all run (a hook per expert would wait for a gather that never comes)
DEFAULT_LEAF_MODULE_CLASSES = ("transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                               "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                               "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock")


class LeafModuleConfig(Section):
    """``zero_optimization.leaf_module``: modules ZeRO-3 gathers as one unit (no hooks inside); repeated
    entries are dropped (DeepSpeed's order kept)."""

    classes: StrList = list(DEFAULT_LEAF_MODULE_CLASSES)
    names: StrList = []
    name_suffixes: StrList = []

    @field_validator("classes", "names", "name_suffixes")
    @classmethod
    def _drop_repeats(cls, value: list) -> list:
        return list(dict.fromkeys(value))


class ZeroConfig(Section):
    """``zero_optimization``."""

    stage: Stage = 0
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    reduce_bucket_size: NonNegInt = 500_000_000
    use_multi_rank_bucket_allreduce: Bool = True
    allgather_partitions: Bool = True
    allgather_bucket_size: NonNegInt = 500_000_000
    overlap_comm: Optional[Bool] = None
    """None means DeepSpeed's dynamic default: true for stage 3, false otherwise (resolved on load)."""
    load_from_fp32_weights: Bool = True
    elastic_checkpoint: Bool = False
    compute_grad_norm: Bool = True
    parameter_alignment: Bool = False
    offload_param: Optional[OffloadParamConfig] = None
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    zenflow: Optional[FreeDict] = None
    """DeepSpeed's ZenFlow section; its keys are validated by `lightspeed.offload.zenflow_config`."""
    sub_group_size: NonNegInt = 1_000_000_000
    stage3_prefetch_bucket_size: NonNegInt = 50_000_000
    stage3_param_persistence_threshold: NonNegInt = 100_000
    stage3_model_persistence_threshold: NonNegInt = sys.maxsize
    stage3_max_live_parameters: NonNegInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegInt = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: Bool = False
    stage3_module_granularity_threshold: Int() = 0
    stage3_use_all_reduce_for_fetch_params: Bool = False
    stage3_allgather_sequential: Bool = False
    ignore_unused_parameters: Bool = True
    legacy_stage1: Bool = False
    round_robin_gradients: Bool = False
    zero_hpz_partition_size: NonNegInt = 1
    zero_quantized_weights: Bool = False
    zero_quantized_nontrainable_weights: Bool = False
    zero_quantized_gradients: Bool = False
    zeropp_loco_param: Optional[FreeDict] = None
    mics_shard_size: Int() = -1
    mics_hierarchical_params_gather: Bool = False
    memory_efficient_linear: Bool = True
    pipeline_loading_checkpoint: Bool = False
    override_module_apply: Bool = True
    log_trace_cache_warnings: Bool = False
    enable_sanity_checks: Bool = False
    save_muon_momentum_buffer_in_memory: Bool = False
    leaf_module: LeafModuleConfig = LeafModuleConfig()

    @model_validator(mode="after")
    def _dynamic_defaults(self):
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        return self

    @property
    def offload_optimizer_device(self) -> str:
        return self.offload_optimizer.device if self.offload_optimizer is not None else "none"

    @property
    def offload_param_device(self) -> str:
        return self.offload_param.device if self.offload_param is not None else "none"


def zero_problems(zero: ZeroConfig) -> list[str]:
    """Rules across keys of the section (DeepSpeed's validators, plus NVMe needing a path)."""
    out = []
    opt = zero.offload_optimizer
    if opt is not None and opt.ratio < 1.0 and zero.stage != 3:
        out.append(
            f"zero_optimization.offload_optimizer.ratio: partial offload (ratio < 1) needs "
            f"zero_optimization.stage 3 (got ratio {opt.ratio} with stage {zero.stage})"
        )
    for name, block in (("offload_optimizer", opt), ("offload_param", zero.offload_param)):
        if block is not None and block.device == "nvme" and not (block.nvme_path or block.nvme_path_per_local_rank):
            out.append(f'zero_optimization.{name}.nvme_path: is required when device is "nvme"')
    return out
