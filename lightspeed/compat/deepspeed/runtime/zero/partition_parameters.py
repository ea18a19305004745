"""`deepspeed.runtime.zero.partition_parameters`: where DeepSpeed defines `Init`, `GatheredParameters`,
`register_external_parameter` and `ZeroParamStatus` (lightspeed.zero's objects), DeepSpeed's
`ZeroParamType` and `is_zero_param`, and the two names
transformers' `prevent_arange_dtype_change` swaps around `from_pretrained` under ZeRO-3.

Note: the tensor-constructor hook
    DeepSpeed's Init wraps torch's tensor constructors through `zero_wrapper_for_fp_tensor_constructor`,
    casting floating tensors made inside to the config's dtype and device; transformers replaces that
    hook for `torch.arange` (`_orig_torch_arange`) so RoPE buffers keep their dtype. lightspeed's Init
    wraps no constructor (parameters are redirected at registration, buffers stay as built), so nothing
    here reads the hook: transformers' swap has nothing to undo, which is the outcome it wants. The
    function is DeepSpeed's, for callers that use it directly.
"""

import enum

import torch

from lightspeed.zero import GatheredParameters, Init, register_external_parameter
from lightspeed.zero.stage3.zero_param import ZeroParameter, ZeroParamStatus

_orig_torch_arange = torch.arange

# the shape of a partitioned parameter's `.data` between gathers (lightspeed's empty placeholder too)
partitioned_param_data_shape = [0]


class ZeroParamType(enum.Enum):
    """DeepSpeed's kinds of ZeRO parameter: a plain one, one partitioned over data parallelism, one held
    by a single rank."""

    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


def is_zero_param(parameter) -> bool:
    """Whether `parameter` is a ZeRO-3 parameter (it has a `ds_id`), DeepSpeed's test."""
    return hasattr(parameter, "ds_id")


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype: torch.dtype, target_device=None):
    """`fn` (a tensor constructor) wrapped so that tensors it makes land on `target_device` when no
    device is given, and floating ones are cast to `target_fp_dtype` (DeepSpeed's semantics)."""

    def wrapped_fn(*args, **kwargs) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = torch.device(target_device)
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped_fn


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType", "ZeroParameter", "is_zero_param", "partitioned_param_data_shape",
           "register_external_parameter", "zero_wrapper_for_fp_tensor_constructor"]
