"""Writing DeepSpeed's pickled objects into checkpoint files without DeepSpeed installed.

Owns `save_with_deepspeed_objects`: ``torch.save`` whose pickle names three of DeepSpeed's classes
(``LossScaler``, ``ZeroStageEnum``, ``fragment_address``) where our stand-ins below appear, exactly as
DeepSpeed's own files name them, so DeepSpeed's loader (``torch.load(weights_only=False)``) rebuilds its
own objects. Must not: import deepspeed, or name any other global (what is not a stand-in is pickled
by torch as usual: tensors, dicts, lists, numbers, strings, ``torch.Size``).

Note: [why DeepSpeed's objects and not plain data]
    DeepSpeed's ZeRO-3 loader assigns the file's ``loss_scaler`` to its optimizer and calls methods on
    it at the next backward; a dict there breaks training. The pickle records a class by module path
    and name only, so naming DeepSpeed's is enough: Python's pickler checks that the class it names is
    importable, which is the one check replaced here (`_Pickler.save_global`).
"""

from __future__ import annotations

import pickle
import types
from typing import Any

import torch

__all__ = ["LossScaler", "ZeroStageEnum", "FragmentAddress", "save_with_deepspeed_objects"]


class LossScaler:
    """DeepSpeed's static loss scaler (``deepspeed.runtime.fp16.loss_scaler.LossScaler``): scale 1.0 is
    what DeepSpeed builds for fp32 and bf16 training."""

    def __init__(self, cur_scale: float = 1.0):
        self.cur_scale = float(cur_scale)
        self.dynamic = False


class ZeroStageEnum:
    """DeepSpeed's ``ZeroStageEnum`` member for a stage (pickled as ``ZeroStageEnum(stage)``)."""

    def __init__(self, stage: int):
        self.stage = int(stage)

    def __reduce__(self):
        return (ZeroStageEnum, (self.stage,))


class FragmentAddress:
    """DeepSpeed's ``fragment_address`` (numel, start): where a parameter's piece lies in a partition."""

    def __init__(self, numel: int, start: int):
        self.numel = int(numel)
        self.start = int(start)


_GLOBALS = {
    LossScaler: ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ZeroStageEnum: ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    FragmentAddress: ("deepspeed.utils.tensor_fragment", "fragment_address"),
}


class _Pickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    def save_global(self, obj: Any, name: str | None = None) -> None:
        target = _GLOBALS.get(obj) if isinstance(obj, type) else None
        if target is None:
            return super().save_global(obj, name)
        module, qualname = target
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("utf-8"))
        self.memoize(obj)


_PICKLE_MODULE = types.ModuleType("lightspeed_deepspeed_pickle")
_PICKLE_MODULE.Pickler = _Pickler


def save_with_deepspeed_objects(obj: Any, path: str) -> None:
    """``torch.save(obj, path)``, the stand-ins above pickled as DeepSpeed's classes."""
    torch.save(obj, path, pickle_module=_PICKLE_MODULE)
