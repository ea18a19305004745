"""``torch_autocast``: fp32 parameters, the forward under ``torch.autocast``, and the gradients of
lower-precision-safe modules reduced in the autocast dtype (DeepSpeed 0.17.2+'s torch_autocast.py).

Owns: resolving the section (the dtype, the module classes named by
``lower_precision_safe_modules``), which parameters communicate in the autocast dtype
(`comm_dtypes`), and the forward's context (`forward_context`). Must not: build buffers or reduce
anything: ZeRO stages 1-3 read `comm_dtypes` and group their gradient buffers by it
(zero/stage12.py, zero/stage3/strategy.py).

Note: [DeepSpeed's rules, kept]
    * The parameters stay in their dtype (fp32 unless fp16/bf16 is enabled too); only the forward's
      operations are autocast.
    * The parameters of a module whose class is exactly one of the safe classes (default
      ``torch.nn.Linear``, ``Conv1d``, ``Conv2d``, ``Conv3d``; subclasses do not count, as
      DeepSpeed tests ``module.__class__ in classes``) get the autocast dtype as their communication
      dtype; the others keep their own. ZeRO stages 1-3 reduce each parameter's gradient in its
      communication dtype (one bucket per dtype) and ignore ``communication_data_type``; stage 0
      reduces as without autocast.
    * An enabled section overrides an autocast the caller opened around the engine's forward.
    * ``dtype`` unset is handed to ``torch.autocast`` as None: torch's default for the device
      (bf16 on CPU, fp16 on CUDA).
    * fp16 autocast adds ``torch.amp.GradScaler``'s loss scaling in DeepSpeed; that is not built here
      and refused with its key.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any

import torch

from lightspeed.config.errors import ConfigError

__all__ = ["AutocastSettings", "DEFAULT_SAFE_MODULES"]

DEFAULT_SAFE_MODULES = ("torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                        "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d")
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "torch.float16": torch.float16}


def _import_class(name: str) -> type:
    package, _, cls = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(package), cls) if package else None
    except (ImportError, AttributeError):
        found = None
    if not isinstance(found, type):
        raise ConfigError(f"torch_autocast.lower_precision_safe_modules: cannot import the module class {name!r}")
    return found


@dataclass(frozen=True)
class AutocastSettings:
    """An enabled ``torch_autocast`` section, resolved for `device_type`."""

    dtype: torch.dtype
    safe_classes: tuple[type, ...]
    device_type: str

    @classmethod
    def from_config(cls, cfg: Any, device_type: str) -> "AutocastSettings | None":
        section = cfg.torch_autocast
        if not section.enabled:
            return None
        dtype = _DTYPES[section.dtype] if section.dtype is not None else torch.get_autocast_dtype(device_type)
        if dtype == torch.float16:
            raise NotImplementedError("torch_autocast.dtype=fp16 (DeepSpeed scales the loss with torch.amp.GradScaler) "
                                      "is not implemented yet; bfloat16 is")
        names = section.lower_precision_safe_modules
        classes = tuple(_import_class(n) for n in (DEFAULT_SAFE_MODULES if names is None else names))
        return cls(dtype, classes, device_type)

    def comm_dtypes(self, module: torch.nn.Module) -> dict[int, torch.dtype]:
        """id(parameter) -> the autocast dtype, for the parameters of the safe modules (the others
        communicate in their own dtype)."""
        out: dict[int, torch.dtype] = {}
        for m in module.modules():
            if m.__class__ in self.safe_classes:
                for p in m.parameters(recurse=False):
                    out[id(p)] = self.dtype
        return out

    def forward_context(self) -> contextlib.AbstractContextManager:
        """The forward's autocast (it replaces one the caller opened)."""
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, enabled=True)
