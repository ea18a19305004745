"""`OnDevice`: DeepSpeed's `deepspeed.OnDevice(dtype, device="meta")`, build a model's parameters on a
device and in a dtype without first making them on the CPU in fp32 (on "meta": without memory at all,
to be filled by `init_inference(model, checkpoint=...)`). Owns the construction context only.

Note: only parameters are redirected, at registration (torch's global parameter-registration hook).
Buffers stay as the constructor made them: a non-persistent buffer computed at construction (the
rotary `inv_freq` of Llama-like models) is in no checkpoint, so it must be real to survive a meta build.
"""

from __future__ import annotations

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook


class ParameterRegistrationContext:
    """Base of the construction contexts (`OnDevice`, `zero.Init`): while entered (and `enabled`), every
    parameter registered on any module passes through `_on_register(module, name, param)`, which
    returns a replacement or None (keep it)."""

    enabled = True
    _handle = None

    def __enter__(self):
        if self.enabled:
            self._enter()
            self._handle = register_module_parameter_registration_hook(self._on_register)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            self._exit(*exc)

    def _enter(self) -> None:
        pass

    def _exit(self, *exc) -> None:
        pass

    def _on_register(self, module: torch.nn.Module, name: str, param):
        raise NotImplementedError


class OnDevice(ParameterRegistrationContext):
    """Context manager: parameters registered on modules built inside are made on `device` ("meta":
    shape and dtype only) in `dtype` (floating-point parameters; None keeps the constructed dtype).
    `enabled=False` makes it do nothing, as in DeepSpeed."""

    def __init__(self, dtype: torch.dtype | None = None, device="meta", enabled: bool = True):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"OnDevice(dtype=...): expected a floating-point torch dtype or None (got {dtype!r})")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"OnDevice(device=...): not a device: {device!r} ({err})") from None
        self.dtype, self.enabled = dtype, enabled
        self._device_context = None

    def _enter(self) -> None:
        if self.device.type != "meta":  # constructors then allocate there directly (no CPU copy first)
            self._device_context = self.device
            self._device_context.__enter__()

    def _exit(self, *exc) -> None:
        if self._device_context is not None:
            self._device_context.__exit__(*exc)
            self._device_context = None

    def _on_register(self, module: torch.nn.Module, name: str, param):
        if param is None:
            return None
        dtype = self.dtype if self.dtype is not None and param.is_floating_point() else param.dtype
        if param.device == self.device and param.dtype == dtype:
            return None
        if self.device.type == "meta":
            data = torch.empty(param.shape, dtype=dtype, device="meta")
        else:
            data = param.detach().to(device=self.device, dtype=dtype)
        return torch.nn.Parameter(data, requires_grad=param.requires_grad)
