"""Training-efficiency research sections: ``compression_training``, ``data_efficiency``,
``curriculum_learning`` (the legacy top-level form), ``progressive_layer_drop``,
``sparse_attention`` and ``eigenvalue``. Keys and defaults follow DeepSpeed's
``compression/config.py``, ``runtime/data_pipeline/constants.py`` and ``runtime/constants.py``.

The first level of each section is modelled (unknown keys are errors there); the deep trees below
it (compression groups, data routing/sampling, curriculum schedules) stay free dicts, since nothing
in lightspeed consumes them yet.
"""

from __future__ import annotations

from typing import Optional

from lightspeed._utils.logging import warn_once
from lightspeed.config.base import Bool, Choice, Float, FreeDict, Int, IntList, NonNegInt, PosInt, Section, Str


class CompressionTrainingConfig(Section):
    """``compression_training``: each technique is ``{"shared_parameters": {...}, "different_groups":
    {...}}`` (``layer_reduction`` is flat)."""

    weight_quantization: FreeDict = {}
    activation_quantization: FreeDict = {}
    sparse_pruning: FreeDict = {}
    row_pruning: FreeDict = {}
    head_pruning: FreeDict = {}
    channel_pruning: FreeDict = {}
    layer_reduction: FreeDict = {}

    def enabled_techniques(self) -> list[str]:
        """Names of the techniques switched on (``shared_parameters.enabled`` or, for
        layer_reduction, ``enabled``)."""
        out = []
        for name in type(self).model_fields:
            block = getattr(self, name)
            shared = block.get("shared_parameters", {}) if name != "layer_reduction" else block
            if isinstance(shared, dict) and shared.get("enabled") is True:
                out.append(name)
        return out


class DataEfficiencyConfig(Section):
    """``data_efficiency``: curriculum sampling and random layerwise token dropping."""

    enabled: Bool = False
    seed: Int() = 1234
    data_routing: FreeDict = {}
    data_sampling: FreeDict = {}


class CurriculumLearningConfig(Section):
    """``curriculum_learning`` (legacy, top level): a difficulty schedule such as sequence length."""

    enabled: Bool = False
    curriculum_type: Optional[Str] = None
    min_difficulty: Optional[Int()] = None
    max_difficulty: Optional[Int()] = None
    schedule_type: Optional[Choice("fixed_linear", "fixed_root", "fixed_discrete", "custom")] = None
    schedule_config: FreeDict = {}


class ProgressiveLayerDropConfig(Section):
    """``progressive_layer_drop``."""

    enabled: Bool = False
    theta: Float() = 1.0
    gamma: Float() = 0.001


SPARSE_MODES = ("dense", "fixed", "variable", "bigbird", "bslongformer")


_SPARSE_MODE_KEYS = {
    "dense": ("block",),
    "fixed": ("block", "different_layout_per_head", "num_local_blocks", "num_global_blocks", "attention",
              "horizontal_global_attention", "num_different_global_patterns"),
    "variable": ("block", "different_layout_per_head", "num_random_blocks", "local_window_blocks",
                 "global_block_indices", "global_block_end_indices", "attention", "horizontal_global_attention"),
    "bigbird": ("block", "different_layout_per_head", "num_random_blocks", "num_sliding_window_blocks",
                "num_global_blocks"),
    "bslongformer": ("block", "different_layout_per_head", "num_sliding_window_blocks", "global_block_indices",
                     "global_block_end_indices"),
}


class SparseAttentionConfig(Section):
    """``sparse_attention``: the union of the keys of every mode; each mode reads its own subset
    (`deepspeed_dict`). The engine does not act on it: models read it to build their sparse attention
    (lightspeed.ops.sparse_attention.sparsity_config_from_dict)."""

    mode: Choice(*SPARSE_MODES) = "fixed"
    block: PosInt = 16
    different_layout_per_head: Bool = False
    num_local_blocks: PosInt = 4
    num_global_blocks: PosInt = 1
    attention: Choice("bidirectional", "unidirectional") = "bidirectional"
    horizontal_global_attention: Bool = False
    num_different_global_patterns: PosInt = 1
    num_random_blocks: NonNegInt = 0
    local_window_blocks: IntList(ge=1) = [4]
    global_block_indices: IntList(ge=0) = [0]
    global_block_end_indices: Optional[IntList(ge=0)] = None
    num_sliding_window_blocks: PosInt = 3

    def deepspeed_dict(self) -> dict:
        """DeepSpeed's parsed form (`DeepSpeedConfig.sparse_attention`): ``mode`` and the keys that mode
        reads, with defaults filled in; the other keys are dropped, as DeepSpeed drops them. (BigBird and
        BSLongformer carry no ``attention``: DeepSpeed's parser does not pass it to them.)"""
        unread = sorted(set(self.model_fields_set) - {"mode", *_SPARSE_MODE_KEYS[self.mode]})
        if unread:
            warn_once(f"sparse_attention: mode {self.mode!r} does not read " + ", ".join(unread)
                      + " (set for another mode; DeepSpeed ignores it too)")
        out = {"mode": self.mode}
        for key in _SPARSE_MODE_KEYS[self.mode]:
            value = getattr(self, key)
            out[key] = list(value) if isinstance(value, list) else value
        return out


class EigenvalueConfig(Section):
    """``eigenvalue``: Hessian eigenvalue estimation used by quantize-aware training (MoQ)."""

    enabled: Bool = False
    verbose: Bool = False
    max_iter: PosInt = 100
    tol: Float(gt=0) = 1e-2
    stability: Float(ge=0) = 1e-6
    gas_boundary_resolution: PosInt = 1
    layer_name: Str = "bert.encoder.layer"
    layer_num: NonNegInt = 0
    model_name: Optional[Str] = None
    """Read by nothing, in DeepSpeed too; accepted because DeepSpeed's own example configs carry it."""
