"""The dtypes of a model's own tensors under mixed precision (DeepSpeed 0.19.8's rules): parameters go to the
training dtype; floating buffers keep the dtype they were built or loaded in unless `data_types.buffer_dtype`
names one; and the buffers the model names for fp32 (`data_types.keep_in_fp32_modules`) stay in fp32.

Owns: the name patterns of `data_types.keep_in_fp32_modules` (`keep_in_fp32_pattern`), the buffers they select
(`fp32_buffers`), upcasting those (`keep_buffers_in_fp32`), and the one cast of a model at set-up
(`cast_module`, which `initialize()` runs at every ZeRO stage; `zero.Init` upcasts the kept buffers of the
models it builds). Must not: touch a strategy's tensors (flat buffers, shards, masters), or communicate.

Note: [the rules]
    Only under fp16 or bf16 training is anything cast (fp32 training leaves the model as given, and
    `buffer_dtype` then does nothing, as in DeepSpeed). Parameters whose dtype is fp16, bf16, fp32 or fp64 go
    to the training dtype (`cast_params=False` at ZeRO stage 3, whose strategy already holds them in it).
    Buffers are not cast by default, so an HF rotary `inv_freq` built in fp32 stays fp32; with `buffer_dtype`
    set, every buffer of those four dtypes goes to it, except the kept ones. DeepSpeed replaced its blanket
    `module.half()` / `.bfloat16()` by this in 0.19.2.

Note: [keep_in_fp32_modules]
    Hugging Face models list tensors for fp32 in two class attributes: `_keep_in_fp32_modules_strict`
    (fp32 under bf16 and fp16) and `_keep_in_fp32_modules` (fp32 under fp16 only); e.g. DeepSeek-V3's MoE
    routing bias `e_score_correction_bias`, whose values are too close together for bf16. The setting:
    "auto" (the default) reads those attributes of every submodule: a name `p` listed by the submodule
    at `path` selects the buffers whose full names match `^path\\..*p` (listed by the root: `p` found
    anywhere); a list gives patterns found anywhere in a buffer's full name; `[]` keeps nothing. In a
    pattern `*` stands for any characters, and the rest is a regular expression as written (transformers'
    rule, so the `.` in `gate.weight` matches any character). Only floating BUFFERS are kept: a listed parameter
    follows the training dtype. A kept buffer that arrives in a lower precision is upcast (its value as it
    is then); under fp32 training the setting selects nothing.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch

from lightspeed._utils.logging import get_logger, warn_once
from lightspeed.config.errors import ConfigError

__all__ = ["KEEP_AUTO", "cast_module", "fp32_buffers", "keep_buffers_in_fp32", "keep_in_fp32_pattern",
           "keep_in_fp32_setting"]

logger = get_logger(__name__)

KEEP_AUTO = "auto"
KEY = "data_types.keep_in_fp32_modules"
#: the dtypes a parameter (and, with buffer_dtype, a buffer) is cast from
CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOW = (torch.float16, torch.bfloat16)


def keep_in_fp32_setting(value) -> str | tuple[str, ...]:
    """`data_types.keep_in_fp32_modules` as given (None: the default) -> "auto" or a tuple of patterns."""
    if value is None or value == KEEP_AUTO:
        return KEEP_AUTO
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f'{KEY}: must be "auto" or a list of name patterns (got {value!r})')


def _regex(name: str) -> str:
    return name.replace("*", ".*")


def keep_in_fp32_pattern(module: torch.nn.Module, setting, dtype: torch.dtype | None) -> re.Pattern | None:
    """The compiled pattern of the buffer names of `module` to keep in fp32 while training in `dtype`, or
    None when none are (fp32 training, `[]`, or a model that lists nothing). See the Note."""
    if dtype not in _LOW:
        return None
    setting = keep_in_fp32_setting(setting)
    if setting == KEEP_AUTO:
        patterns = set()
        for path, sub in module.named_modules():
            names = set(getattr(sub, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:
                names |= set(getattr(sub, "_keep_in_fp32_modules", None) or ())
            patterns.update(rf"^{re.escape(path)}\..*{_regex(n)}" if path else _regex(n) for n in names)
    else:
        patterns = {_regex(n) for n in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def fp32_buffers(module: torch.nn.Module, pattern: re.Pattern | None) -> list[tuple[str, torch.Tensor]]:
    """(full name, buffer) of the floating buffers of `module` whose full names `pattern` finds."""
    if pattern is None:
        return []
    found = []
    for path, owner in module.named_modules():
        prefix = f"{path}." if path else ""
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and pattern.search(prefix + name):
                found.append((prefix + name, buf))
    return found


def keep_buffers_in_fp32(module: torch.nn.Module, pattern: re.Pattern | None) -> list[str]:
    """Upcast, in place (the same tensor objects), the selected buffers not yet fp32; returns their names."""
    upcast = []
    for name, buf in fp32_buffers(module, pattern):
        if buf.dtype != torch.float32:
            buf.data = buf.data.float()
            upcast.append(name)
    return upcast


def _cast(tensors: Iterable[torch.Tensor], dtype: torch.dtype, skip: set[int]) -> None:
    for t in tensors:
        if id(t) not in skip and t.dtype in CASTABLE and t.dtype != dtype:
            t.data = t.data.to(dtype)


def cast_module(module: torch.nn.Module, param_dtype: torch.dtype, buffer_dtype: torch.dtype | None = None,
                keep_in_fp32="auto", cast_params: bool = True) -> None:
    """Give `module`'s parameters and buffers their dtypes for training in `param_dtype` (the Note's rules),
    in place: the same Parameter and buffer objects, their `.data` replaced."""
    if param_dtype not in _LOW:
        if buffer_dtype is not None:
            warn_once(f"data_types.buffer_dtype={str(buffer_dtype).removeprefix('torch.')}: buffers are cast only "
                      "under fp16 or bf16 training (as in DeepSpeed); this run trains in fp32 and leaves them as "
                      "they are", logger)
        return
    if cast_params:
        _cast(module.parameters(), param_dtype, set())
    pattern = keep_in_fp32_pattern(module, keep_in_fp32, param_dtype)
    kept = fp32_buffers(module, pattern)
    upcast = keep_buffers_in_fp32(module, pattern)
    if kept:
        logger.info("data_types.keep_in_fp32_modules: %d buffers kept in fp32 (%d upcast): %s", len(kept),
                    len(upcast), ", ".join(n for n, _ in kept[:8]) + (", ..." if len(kept) > 8 else ""))
    if buffer_dtype is not None:
        _cast(module.buffers(), buffer_dtype, {id(b) for _, b in kept})
