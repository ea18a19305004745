"""The ``tensor_parallel`` section: DeepSpeed's AutoTP training settings, keys and defaults as DeepSpeed's
``runtime/tensor_parallel/config.py`` (`TPTrainingConfig`) and its ``partition_config`` as
``module_inject/autotp_config.py`` reads it. Owns the section shapes only; the plan they describe is
built by lightspeed/parallel/autotp.py.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import model_validator

from lightspeed.config.base import Bool, Choice, NonNegInt, PosInt, Section, Str

CEBackend = Choice("torch", "liger")
PartitionType = Choice("column", "row", "skip", normalize=str.lower)
_ALIASES = {"tp": "tensor_parallel", "kernel_inject": "replace_with_kernel_inject"}


class TPGroupConfig(Section):
    """``tensor_parallel.tensor_parallel`` (alias ``tp``): DeepSpeed's inference-style TPConfig."""

    tp_size: PosInt = 1
    tp_grain_size: PosInt = 1
    mpu: Any = None
    tp_group: Any = None


class TPLayerSpecConfig(Section):
    """One entry of ``partition_config.layer_specs``."""

    patterns: list[Str]
    partition_type: PartitionType = "column"
    shape: Optional[list[Any]] = None
    partition_dim: Optional[NonNegInt] = None
    model_types: Optional[list[Str]] = None
    gather_output: Bool = False


class PartitionConfig(Section):
    """``tensor_parallel.partition_config``: layer specs matched (re.match) against parameter names."""

    layer_specs: list[TPLayerSpecConfig] = []
    tp_size: PosInt = 1
    embedding_partition_dim: NonNegInt = 1
    lm_head_patterns: list[Str] = ["lm_head", "embed_out"]
    use_default_specs: Bool = True
    strict_mode: Bool = False


class TensorParallelConfig(Section):
    """``tensor_parallel``: `autotp_size` > 1 splits the model's planned linear layers over that many
    ranks (0 and 1: off)."""

    autotp_size: NonNegInt = 0
    dtype: Any = None
    """DeepSpeed's `tp_model_init` dtype; in training the precision sections decide the dtype."""
    tp_overlap_comm: Bool = False
    vocab_parallel_lm_head: Optional[Bool] = None
    """DeepSpeed 0.19.8: true shards the output projection over the vocabulary, false never, None as the
    model's tied-embedding plan allows."""
    vocab_parallel_ce_backend: CEBackend = "torch"
    tensor_parallel: TPGroupConfig = TPGroupConfig()
    injection_policy_tuple: Any = None
    partition_config: Optional[PartitionConfig] = None
    preset_model: Optional[Str] = None
    keep_module_on_host: Bool = False
    replace_with_kernel_inject: Bool = False

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, value):
        if isinstance(value, dict):
            value = {_ALIASES.get(key, key): item for key, item in value.items()}
        return value

    @property
    def tp_size(self) -> int:
        return max(self.autotp_size, 1)
