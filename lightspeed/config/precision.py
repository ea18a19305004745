"""Precision sections: ``fp16``, ``bf16`` (legacy name ``bfloat16``), ``amp``, ``torch_autocast``
and ``data_types``. Keys and defaults follow DeepSpeed's ``runtime/precision_config.py`` and
``runtime/constants.py``. Owns the per-section shape only; the rule that fp16 and bf16 exclude each
other lives in `model.py`, and loss scaling itself lives in ``lightspeed.precision``.
"""

from __future__ import annotations

from typing import Annotated, Optional, Union

from pydantic import BeforeValidator, ConfigDict

from lightspeed.config.base import Bool, Choice, Float, Int, Section, StrList, expectation

DTYPE_NAMES = ("fp32", "fp16", "bf16")

# Names DeepSpeed's DtypeEnum accepts for torch_autocast.dtype (low-precision ones are what make sense).
AUTOCAST_DTYPE_NAMES = (
    "bfloat16", "bf16", "torch.bfloat16",
    "float16", "fp16", "half", "torch.float16",
)  # fmt: skip


def _check_keep_in_fp32(value):
    if value == "auto" or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise expectation('must be "auto" or a list of name patterns')


KeepInFp32 = Annotated[Union[str, list], BeforeValidator(_check_keep_in_fp32)]


class FP16Config(Section):
    """``fp16``: mixed precision with fp16 compute and a (dynamic by default) loss scale."""

    enabled: Bool = False
    auto_cast: Bool = False
    """Cast the module's floating-point inputs to fp16."""
    loss_scale: Float(ge=0, numeric_strings=True) = 0.0
    """0 selects dynamic loss scaling; any other value is a static scale. A numeric string ("3") reads
    as its number, as DeepSpeed's `float(...)` of the value does."""
    initial_scale_power: Int(ge=0) = 16
    """The dynamic scale starts at 2**initial_scale_power."""
    loss_scale_window: Int() = 1000
    """Steps without overflow before the dynamic scale is raised."""
    hysteresis: Int() = 2
    """Overflows tolerated before the dynamic scale is lowered (DeepSpeed's delayed shift)."""
    consecutive_hysteresis: Bool = False
    """Refill the hysteresis after every step without overflow."""
    min_loss_scale: Int() = 1
    """Floor of the dynamic scale. loss_scale_window, hysteresis and min_loss_scale are checked to be
    positive only when dynamic scaling is in use (enabled and loss_scale 0), as DeepSpeed does."""
    fp16_master_weights_and_grads: Bool = False
    """Keep master weights and gradients in fp16 (ZeRO 1-3 with CPU offload only)."""

    @property
    def dynamic(self) -> bool:
        """True when the loss scale is dynamic (loss_scale == 0)."""
        return self.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return float(2**self.initial_scale_power)


class BF16Config(Section):
    """``bf16``: mixed precision with bf16 compute; no loss scaling."""

    enabled: Bool = False
    immediate_grad_update: Bool = False
    """Apply each gradient to the fp32 accumulator as soon as it is produced."""
    check_grad_overflow: Bool = True
    """Skip the step when a gradient is inf/nan (DeepSpeed's default since PR #6976)."""
    bf16_master_weights_and_grads: Bool = False
    """Keep ZeRO master weights and gradients in bf16 (ZeRO 1-3)."""
    bf16_optimizer_states: Bool = False
    """Keep optimizer states in bf16 too; needs bf16_master_weights_and_grads."""
    stochastic_rounding: Bool = False
    """lightspeed's own key (off by default): write the bf16 master weights, and with
    bf16_optimizer_states the bf16 optimizer states, with stochastic rounding instead of round-to-nearest
    (an update below half a bf16 gap then moves the value with the matching probability instead of
    never); needs bf16_master_weights_and_grads and an optimizer that rounds so (FusedAdam, FusedLion,
    FusedAdagrad, the CPU Adam when offloaded). The random bits come from torch's initial seed."""


class AMPConfig(Section):
    """``amp``: NVIDIA apex AMP. Every key besides `enabled` is passed to ``amp.initialize`` as
    DeepSpeed does, so the section accepts any other key."""

    model_config = ConfigDict(extra="allow")

    enabled: Bool = False

    def params(self) -> dict:
        """The keys passed through to apex (everything but `enabled`)."""
        return dict(self.model_extra or {})


class TorchAutocastConfig(Section):
    """``torch_autocast``: run the forward under ``torch.autocast``."""

    enabled: Bool = False
    dtype: Optional[Choice(*AUTOCAST_DTYPE_NAMES, normalize=str.lower)] = None
    """Lower-precision dtype; None is handed to torch.autocast as DeepSpeed does: torch's default for the
    device (bf16 on CPU, fp16 on CUDA)."""
    lower_precision_safe_modules: Optional[StrList] = None
    """Module classes (dotted names) whose grads/params may be communicated in `dtype`."""


class DataTypesConfig(Section):
    """``data_types``: dtypes DeepSpeed lets the user pick apart from the compute precision."""

    grad_accum_dtype: Optional[Choice(*DTYPE_NAMES, normalize=str.lower)] = None
    """dtype gradients accumulate in across micro-steps; None means the model's dtype."""
    param_dtype: Optional[Choice(*DTYPE_NAMES, normalize=str.lower)] = None
    buffer_dtype: Optional[Choice(*DTYPE_NAMES, normalize=str.lower)] = None
    keep_in_fp32_modules: KeepInFp32 = "auto"
    """DeepSpeed 0.19.8's buffers kept in fp32 under bf16/fp16 training: "auto" (the model's own transformers
    `_keep_in_fp32_modules(_strict)` lists) or a list of name patterns."""


def torch_dtype_name(name: Optional[str]) -> Optional[str]:
    """Canonical short name (fp16/bf16/fp32) for any dtype spelling DeepSpeed accepts."""
    if name is None:
        return None
    lowered = name.lower()
    if lowered in ("bfloat16", "bf16", "torch.bfloat16"):
        return "bf16"
    if lowered in ("float16", "fp16", "half", "torch.float16"):
        return "fp16"
    if lowered in ("float32", "fp32", "float", "torch.float32"):
        return "fp32"
    return lowered


__all__ = [
    "AMPConfig", "BF16Config", "DataTypesConfig", "FP16Config", "TorchAutocastConfig", "torch_dtype_name",
]  # fmt: skip
