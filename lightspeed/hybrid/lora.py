"""LoRA fused into the base weights for the length of a generation, and taken out exactly after.

Owns `fused_lora(model)`: a context manager that, on entry, folds every LoRA adapter of the model into
its base layer's weight, so the generation's forwards run plain linear layers, and on exit puts every
base tensor back as it was, bit for bit. Two kinds of adapter are recognised:

- DeepSpeed-Chat's (its `LinearLayer_LoRA`, vendored by the training script): a module with the
  attributes `lora_right_weight` ([in, r]), `lora_left_weight` ([r, out]) and `lora_scaling`. DeepSpeed's
  hybrid engine finds adapters by the `lora_right_weight` attribute and adds
  `lora_scaling * lora_left_weight.t() @ lora_right_weight.t()` to the weight. The module's own
  `fuse_lora_weight()` / `unfuse_lora_weight()` do exactly that and also switch its forward to the fused
  weight (its `fuse_lora` flag), so they are called; a module already fused (`fuse_lora` true) is left
  alone.
- PEFT's LoRA layers (`peft.tuners.tuners_utils.BaseTunerLayer`), when peft has been imported: the
  layer's own `merge()` / `unmerge()`, for the active adapters; a layer already merged, or with its
  adapters disabled, is left alone.

Must not: gather parameters (the caller has them gathered: ZeRO-3's `unshard`), change anything the
module does not already change through its own methods, or import peft (a model holding PEFT layers
has imported it).

Note: [exact restore] Unfusing by subtracting the product again (DeepSpeed's and PEFT's `unfuse` /
`unmerge`) leaves the weight a rounding error away from where it was, and that error accumulates over
an RLHF run's thousands of generate calls. So before fusing, each base tensor's storage (`param.data`,
the object itself) and a copy of its values are kept; after the module's own unfuse (which resets its
flags and bookkeeping) the values are copied back into that same storage and `param.data` pointed at it
again (a merge variant may have replaced `.data`; ZeRO's buffers must keep their storage). The copies
cost one extra adapted weight's memory per adapted layer for the generation's length.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from lightspeed._utils.logging import get_logger, warn_once

logger = get_logger(__name__)


def is_dschat_lora(module: nn.Module) -> bool:
    """DeepSpeed's test: a module with a `lora_right_weight` attribute is a LoRA layer."""
    return hasattr(module, "lora_right_weight")


def _peft_layer_type():
    peft_utils = sys.modules.get("peft.tuners.tuners_utils")
    return None if peft_utils is None else getattr(peft_utils, "BaseTunerLayer", None)


def lora_modules(model: nn.Module) -> list[nn.Module]:
    """The model's LoRA layers of either kind, in module order."""
    peft_type = _peft_layer_type()
    return [m for m in model.modules()
            if is_dschat_lora(m) or (peft_type is not None and isinstance(m, peft_type))]


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapters' own parameters (what a LoRA-only run trains)."""
    out = []
    for m in lora_modules(model):
        if is_dschat_lora(m):
            out += [p for p in (m.lora_right_weight, m.lora_left_weight) if isinstance(p, nn.Parameter)]
        else:
            out += [p for n, p in m.named_parameters() if n.startswith(("lora_", "lora."))]
    return out


def _base_tensors(module: nn.Module) -> list[nn.Parameter]:
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    return [p for p in (getattr(base, "weight", None), getattr(base, "bias", None)) if isinstance(p, torch.Tensor)]


class _Fused:
    """One module's fuse, and the exact restore of its base tensors."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.saved = [(p, p.data, p.data.clone()) for p in _base_tensors(module)]

    def restore(self) -> None:
        for param, storage, values in self.saved:
            storage.copy_(values)
            param.data = storage


def _fuse_dschat(module: nn.Module) -> _Fused | None:
    if getattr(module, "fuse_lora", False) is True:
        return None  # fused by the user (convert_lora_to_linear_layer): already a plain layer
    fuse, unfuse = getattr(module, "fuse_lora_weight", None), getattr(module, "unfuse_lora_weight", None)
    if not (callable(fuse) and callable(unfuse)):
        warn_once(f"hybrid engine: {type(module).__name__} has lora_right_weight but no fuse_lora_weight / "
                  "unfuse_lora_weight methods, so its forward's own LoRA path runs unfused during generation",
                  logger)
        return None
    fused = _Fused(module)
    fuse()
    return fused


def _fuse_peft(module: nn.Module) -> _Fused | None:
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return None
    fused = _Fused(module)
    module.merge()
    return fused


def _unfuse(fused: _Fused) -> None:
    module = fused.module
    if is_dschat_lora(module):
        module.unfuse_lora_weight()
    else:
        module.unmerge()
    fused.restore()  # Note: [exact restore]


@contextlib.contextmanager
def fused_lora(model: nn.Module, enabled: bool = True):
    """Fuse every LoRA layer of `model` into its base weight inside the block; on exit (also by an
    exception) unfuse and put each base tensor back exactly (Note: [exact restore]). Yields the number
    of layers fused. The parameters must be whole (gathered) inside the block."""
    fused: list[_Fused] = []
    try:
        if enabled:
            with torch.no_grad():
                for module in lora_modules(model):
                    one = _fuse_dschat(module) if is_dschat_lora(module) else _fuse_peft(module)
                    if one is not None:
                        fused.append(one)
        yield len(fused)
    finally:
        with torch.no_grad():
            for one in reversed(fused):
                _unfuse(one)


__all__ = ["fused_lora", "is_dschat_lora", "lora_modules", "lora_parameters"]
