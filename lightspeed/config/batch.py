"""The batch-size triad: ``train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * world_size``, resolved and checked exactly as DeepSpeed's
``DeepSpeedConfig._set_batch_related_parameters`` and ``_batch_assertion`` do, with problems worded
for people. Also finds the data-parallel world size when the caller does not give one.

Pure integer logic plus one read of the environment; must not import torch.distributed (the
layering keeps that import in ``lightspeed.comm``), so an initialized process group is found through
``sys.modules``: if torch.distributed was never imported, no group can be initialized.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from lightspeed.config.base import as_int, show
from lightspeed.config.errors import ConfigError

TRAIN, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
BATCH_KEYS = (TRAIN, MICRO, GAS)
# Larger than any real batch: a value above it is a slip (1e30, a misplaced token count) that would
# otherwise pass here and fail deep inside the data loader or an int32 index.
MAX_BATCH_SIZE = 2**31 - 1


def detect_world_size(world_size: Optional[int] = None) -> tuple[int, str]:
    """The data-parallel world size and where it came from: the argument, else the initialized
    torch.distributed group, else env WORLD_SIZE, else 1. With pipeline or tensor parallelism the
    caller must pass the data-parallel size itself."""
    if world_size is not None:
        count = as_int(world_size)
        if count is None or count < 1:
            raise ConfigError(f"world_size: must be a positive integer (got {show(world_size)})")
        return count, "the world_size argument"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size()), "torch.distributed"
    env = os.environ.get("WORLD_SIZE")
    if env is not None and env.strip():
        try:
            count = int(env)
        except ValueError:
            count = 0
        if count < 1:
            raise ConfigError(f"env WORLD_SIZE: must be a positive integer (got {show(env)})")
        return count, "env WORLD_SIZE"
    return 1, "the default (no torch.distributed group and no WORLD_SIZE in the environment)"


def resolve_batch(
    train: Optional[int], micro: Optional[int], gas: Optional[int], world_size: int, source: str
) -> tuple[Optional[int], Optional[int], Optional[int], list[str]]:
    """Fill in the missing members of the triad from the given ones and check the result.

    Returns ``(train, micro, gas, problems)``; given values must already be positive ints. The
    derivations use floor division like DeepSpeed, so an indivisible combination shows up as a
    failed product check naming what was derived.
    """
    w = world_size
    where = f"world_size {w} from {source}"
    too_large = [f"{key}: must be at most 2**31 - 1 = {MAX_BATCH_SIZE} (got {value})"
                 for key, value in ((TRAIN, train), (MICRO, micro), (GAS, gas))
                 if value is not None and value > MAX_BATCH_SIZE]
    if too_large:
        return train, micro, gas, too_large
    derived_key, formula = "", ""
    if train is not None and micro is not None and gas is not None:
        pass
    elif train is not None and micro is not None:
        gas = train // micro // w
        derived_key, formula = GAS, f"{TRAIN} // {MICRO} // world_size = {train} // {micro} // {w} = {gas}"
    elif train is not None and gas is not None:
        micro = train // w // gas
        derived_key, formula = MICRO, f"{TRAIN} // world_size // {GAS} = {train} // {w} // {gas} = {micro}"
    elif micro is not None and gas is not None:
        train = micro * gas * w
    elif train is not None:
        gas = 1
        micro = train // w
        derived_key, formula = MICRO, f"{TRAIN} // world_size = {train} // {w} = {micro} ({GAS} set to 1)"
    elif micro is not None:
        train = micro * w
        gas = 1
    else:
        only = f", only {GAS}={gas}" if gas is not None else ""
        return None, None, None, [f"{TRAIN}, {MICRO}: at least one must be given (got neither{only})"]

    if micro < 1:
        return train, micro, gas, [
            f"{MICRO}: must be > 0 (got {micro}, derived as {formula}; {TRAIN} must be at least "
            f"world_size * {GAS} = {w * gas}; {where})"
        ]
    if gas < 1:
        return train, micro, gas, [
            f"{GAS}: must be > 0 (got {gas}, derived as {formula}; {TRAIN} must be at least "
            f"{MICRO} * world_size = {micro * w}; {where})"
        ]
    if train != micro * gas * w:
        note = f"; {derived_key} derived as {formula}" if derived_key else ""
        return train, micro, gas, [
            f"{TRAIN}: must equal {MICRO} * {GAS} * world_size = {micro} * {gas} * {w} = {micro * gas * w} "
            f"(got {train}{note}; {where})"
        ]
    if train > MAX_BATCH_SIZE:
        return train, micro, gas, [f"{TRAIN}: must be at most 2**31 - 1 = {MAX_BATCH_SIZE} (got {train} = "
                                   f"{MICRO} * {GAS} * world_size = {micro} * {gas} * {w}; {where})"]
    return train, micro, gas, []
