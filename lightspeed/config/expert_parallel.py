"""The ``expert_parallel`` section: DeepSpeed's AutoEP settings, with the keys and defaults of DeepSpeed
0.19's ``module_inject/auto_ep_config.py`` (`parse_autoep_config`). Owns the section's shape and the
per-key value checks; the detection and the expert-parallel swap it asks for are built by
lightspeed/parallel/experts/autoep.py, which also refuses the keys it does not build.

Note: ["auto" and None] As DeepSpeed: "auto" (score_apply, combine_impl, score_func, top_k,
routed_scaling_factor) and None (route_norm, the pattern and weight-name overrides, the group counts)
mean "as the model's own preset or router does"; `expert_w3` absent means the preset's layout, null a
fused gate|up weight.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import field_validator

from lightspeed.config.base import Bool, NonNegInt, PosInt, Section, Str

_UNSET = "<unset>"  # `expert_w3` not given (DeepSpeed's _UNSET sentinel)


class ExpertParallelConfig(Section):
    """``expert_parallel``: with `enabled`, `initialize()` finds the model's Hugging Face MoE blocks
    and splits their experts over `autoep_size` ranks."""

    enabled: Bool = False
    autoep_size: PosInt = 1
    expert_tensor_parallel_size: PosInt = 1
    validate_folding_routing: Bool = False
    async_split_plan: Bool = False
    preset_model: Optional[Str] = None
    moe_layer_pattern: Optional[Str] = None
    expert_pattern: Optional[Str] = None
    router_pattern: Optional[Str] = None
    use_grouped_mm: Bool = True
    disable_triton_grouped_mm: Bool = False
    route_norm: Optional[Bool] = None
    route_scale: float = 1.0
    score_apply: Str = "auto"
    combine_impl: Str = "auto"
    row_weighting_impl: Str = "auto"
    gate_up_impl: Str = "separate"
    comm_backend: Str = "comm"
    comm_num_sm: PosInt = 12
    comm_qp_margin: NonNegInt = 4
    comm_max_tokens_per_rank: NonNegInt = 0
    num_expert_groups: Optional[PosInt] = None
    num_limited_groups: Optional[PosInt] = None
    score_func: Str = "auto"
    top_k: Union[PosInt, Str] = "auto"
    load_balance_coeff: Optional[float] = None
    routed_scaling_factor: Union[float, Str] = "auto"
    expert_w1: Optional[Str] = None
    expert_w2: Optional[Str] = None
    expert_w3: Optional[Str] = _UNSET
    num_experts_attr: Optional[Str] = None
    top_k_attr: Optional[Str] = None
    has_shared_experts: Optional[Bool] = None
    shared_experts_pattern: Optional[Str] = None
    shared_experts_gate_pattern: Optional[Str] = None
    expert_activation: Optional[Str] = None

    @field_validator("score_apply")
    @classmethod
    def _score_apply(cls, value: Any) -> Any:
        return _one_of(value, ("auto", "pre", "post"))

    @field_validator("combine_impl")
    @classmethod
    def _combine_impl(cls, value: Any) -> Any:
        return _one_of(value, ("auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"))

    @field_validator("row_weighting_impl")
    @classmethod
    def _row_weighting_impl(cls, value: Any) -> Any:
        return _one_of(value, ("auto", "eager", "fused"))

    @field_validator("gate_up_impl")
    @classmethod
    def _gate_up_impl(cls, value: Any) -> Any:
        return _one_of(value, ("separate", "fused"))

    @field_validator("comm_backend")
    @classmethod
    def _comm_backend(cls, value: Any) -> Any:
        return _one_of(value, ("comm", "deepep"))

    @field_validator("score_func")
    @classmethod
    def _score_func(cls, value: Any) -> Any:
        return _one_of(value, ("auto", "softmax", "sigmoid"))

    @field_validator("top_k", "routed_scaling_factor")
    @classmethod
    def _auto_or_number(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "auto":
            raise ValueError("must be a number or 'auto'")
        return value

    @field_validator("expert_w1", "expert_w2", "expert_w3", "num_experts_attr", "top_k_attr", "router_pattern",
                     "expert_pattern", "shared_experts_pattern", "shared_experts_gate_pattern")
    @classmethod
    def _attribute_name(cls, value: Any) -> Any:
        if value is not None and value != _UNSET and (value == "" or "." in value):
            raise ValueError("must be a direct attribute name, non-empty and without dots")
        return value

    @property
    def expert_w3_given(self) -> bool:
        return self.expert_w3 != _UNSET


def _one_of(value: Any, allowed: tuple[str, ...]) -> Any:
    if value not in allowed:
        raise ValueError(f"must be one of {', '.join(allowed)}")
    return value


__all__ = ["ExpertParallelConfig"]
