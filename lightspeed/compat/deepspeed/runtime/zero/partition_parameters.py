"""`deepspeed.runtime.zero.partition_parameters`: where DeepSpeed defines `Init`, `GatheredParameters`,
`register_external_parameter` and `ZeroParamStatus`; lightspeed.zero's objects.

It also holds the two private names transformers reaches for. Its `prevent_arange_dtype_change()`
(entered around `zero.Init` in `from_pretrained` / `from_config`) swaps
`zero_wrapper_for_fp_tensor_constructor` for a version that leaves `torch.arange` alone and compares
against `_orig_torch_arange`, because DeepSpeed's Init wraps torch's tensor constructors so that
floating-point tensors made inside the block (RoPE's `inv_freq` included) are cast to the training
dtype. lightspeed's Init wraps no constructor (it redirects parameters at registration: buffers keep the
dtype they were made in), so it never calls the wrapper; the names are here, with DeepSpeed's behaviour
for any caller, so that the patch has something to swap.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from lightspeed.compat.deepspeed.accelerator import get_accelerator
from lightspeed.zero import GatheredParameters, Init, register_external_parameter
from lightspeed.zero.stage3.zero_param import ZeroParameter, ZeroParamStatus

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype, target_device=None) -> Callable:
    """DeepSpeed's constructor wrapper: `fn` (a tensor constructor) made on `target_device` (default: this
    rank's accelerator) unless a device is passed, floating-point results cast to `target_fp_dtype`."""

    def wrapped(*args, **kwargs) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = target_device if target_device is not None else torch.device(
                get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParameter", "register_external_parameter"]
