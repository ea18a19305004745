"""Checking a saved module state_dict against the module it is about to be loaded into, before anything
is copied (so a load that would fail half-way fails before it starts).

Owns the comparison of names and shapes only. Must not: copy values or know a ZeRO stage (each strategy
reports its parameters' full shapes, partitioned or not).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lightspeed.checkpoint.errors import CheckpointError


def check_module_state(expected: Mapping[str, tuple[int, ...]], saved: Mapping[str, Any], *, strict: bool) -> None:
    """`expected`: name -> full shape of every entry of the module's state_dict. Raises CheckpointError
    naming the first problem: a shape that differs, or (when `strict`) missing or unexpected names."""
    if not isinstance(saved, Mapping):
        raise CheckpointError("checkpoint: the module state is not a dict of tensors")
    for name, value in saved.items():
        if name in expected and torch.is_tensor(value) and tuple(value.shape) != tuple(expected[name]):
            raise CheckpointError(f"checkpoint: {name} has shape {tuple(value.shape)}, the model's is "
                                  f"{tuple(expected[name])}")
    if strict:
        missing = [k for k in expected if k not in saved]
        unexpected = [k for k in saved if k not in expected]
        if missing or unexpected:
            raise CheckpointError(f"checkpoint: the module state does not match the model: missing "
                                  f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                                  f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
