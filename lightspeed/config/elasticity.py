"""Elastic batch sizes: one global batch size that many data-parallel world sizes can run, found with
DeepSpeed's rules (``deepspeed/elasticity/elasticity.py``, versions 0.1 and 0.2), so a job restarted
at another world size keeps its batch size and so its convergence.

Owns `compute_elastic_config` (DeepSpeed's signature and results), `elastic_batch` (the triad the
engine runs at a world size) and the elasticity errors. Must not import torch; it reads the
environment only for DeepSpeed's two variables (``WORLD_SIZE`` for version 0.2 without a world
size, ``DEEPSPEED_ELASTICITY_CONFIG`` for the scheduler's copy of the section).

Note: [the search]
    Version 0.1 scales each micro batch, and their least common multiple, by the largest highly
    composite number (a number with more divisors than any smaller one) that keeps it within
    ``max_train_batch_size``; a base already over the cap is dropped. Each candidate's valid GPU
    counts are the divisors of ``batch // micro`` for every micro batch dividing it (``batch // micro``
    itself, and divisors up to its half), within ``[min_gpus, max_gpus]``. The candidate with the most
    valid counts wins; ties go to the larger batch (``prefer_larger_batch``, default) or the smaller.
    Version 0.2 runs the same search per node (``num_gpus_per_node / model_parallel_size``
    data-parallel ranks each) and, when the current world size is not among the results, falls back
    to the largest (or smallest) multiple of ``micro * dp_size`` within the cap for that world size
    alone. The arithmetic (float divisions truncated with ``int``, the HCN table's last entry when the
    cap is beyond it) is DeepSpeed's, so the answers are identical.

Note: [where this differs from DeepSpeed]
    Errors only: `return_microbatch=True` without a world size at version 0.1 (DeepSpeed divides by
    the zero world size) is an `ElasticityConfigError`; the scheduler's copy in
    ``DEEPSPEED_ELASTICITY_CONFIG`` may be the section or a whole ds_config holding it (DeepSpeed reads
    the top level as the section, so a whole config compares as the defaults); a missing copy is not
    logged.
"""

from __future__ import annotations

import json
import math
import os
from functools import reduce
from typing import Any, Optional

from lightspeed.config.batch import BATCH_KEYS
from lightspeed.config.errors import ConfigError

LATEST_ELASTICITY_VERSION = 0.2
MINIMUM_DEEPSPEED_VERSION = "0.3.8"
SCHEDULER_CONFIG_ENV = "DEEPSPEED_ELASTICITY_CONFIG"

# The 38 smallest highly composite numbers: candidates up to 720720 per base.
HCN_LIST = (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080, 15120,
            20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640, 498960, 554400,
            665280, 720720)


class ElasticityError(ConfigError):
    """An elastic training problem (DeepSpeed's `deepspeed.elasticity.config.ElasticityError`)."""


class ElasticityConfigError(ElasticityError):
    """The ``elasticity`` section is missing, disabled or invalid."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one of the GPU counts the elastic config allows."""


class ElasticSettings:
    """The ``elasticity`` section checked as DeepSpeed's `ElasticityConfig` checks it (same defaults)."""

    def __init__(self, section: dict):
        if not isinstance(section, dict):
            raise ElasticityConfigError(f"elasticity: must be an object (got {type(section).__name__})")
        self.enabled = section.get("enabled", False)
        if self.enabled:
            for key in ("max_train_batch_size", "micro_batch_sizes"):
                if key not in section:
                    raise ElasticityConfigError(f"elasticity.{key}: required when elasticity is enabled")
        self.max_acceptable_batch_size = section.get("max_train_batch_size", 2000)
        self.micro_batches = section.get("micro_batch_sizes", [2, 4, 6])
        mb = self.micro_batches
        if not isinstance(mb, list) or not all(isinstance(m, int) and not isinstance(m, bool) and m > 0 for m in mb):
            raise ElasticityConfigError(f"elasticity.micro_batch_sizes: must be a list of positive integers (got {mb!r})")
        self.min_gpus = section.get("min_gpus", 1)
        self.max_gpus = section.get("max_gpus", 10000)
        if self.min_gpus < 1 or self.max_gpus < 1:
            raise ElasticityConfigError(f"elasticity.min_gpus, elasticity.max_gpus: must be > 0 (got {self.min_gpus}, "
                                        f"{self.max_gpus})")
        if self.max_gpus < self.min_gpus:
            raise ElasticityConfigError(f"elasticity.max_gpus: must be >= elasticity.min_gpus ({self.min_gpus}) "
                                        f"(got {self.max_gpus})")
        self.model_parallel_size = section.get("model_parallel_size", 1)
        if self.model_parallel_size < 1:
            raise ElasticityConfigError(f"elasticity.model_parallel_size: must be >= 1 (got {self.model_parallel_size})")
        self.num_gpus_per_node = section.get("num_gpus_per_node", 1)
        if self.num_gpus_per_node < 1:
            raise ElasticityConfigError(f"elasticity.num_gpus_per_node: must be >= 1 (got {self.num_gpus_per_node})")
        self.min_time = section.get("min_time", 0)
        if self.min_time < 0:
            raise ElasticityConfigError(f"elasticity.min_time: must be >= 0 (got {self.min_time})")
        self.version = section.get("version", LATEST_ELASTICITY_VERSION)
        self.prefer_larger_batch_size = section.get("prefer_larger_batch", True)
        self.ignore_non_elastic_batch_info = section.get("ignore_non_elastic_batch_info", False)


def _candidate_batch_sizes(bases: list[int], cap: int) -> list[int]:
    out = set()
    for base in bases:
        if base > cap:
            continue  # scaling only grows it
        if base == cap:
            out.add(base)
            continue
        value = cap // base
        above = [i for i, h in enumerate(HCN_LIST) if h > value]
        index = above[0] if above else 0  # DeepSpeed's argmax: 0 when none is larger, so the last entry
        out.add(HCN_LIST[index - 1] * base)
    return list(out)


def _valid_gpus(batch_size: int, micro_batches: list[int], min_gpus: int, max_gpus: int) -> list[int]:
    found = set()
    for micro in micro_batches:
        if batch_size % micro:
            continue
        most = batch_size // micro
        if min_gpus <= most <= max_gpus:
            found.add(most)
        for i in range(1, most // 2 + 1):
            if i > max_gpus:
                break
            if i >= min_gpus and most % i == 0:
                found.add(i)
    return sorted(found)


def _best(candidates: list[int], micro_batches: list[int], min_gpus: int, max_gpus: int, prefer_larger: bool):
    best_count, best_gpus, best_batch = 0, None, int(min(micro_batches))
    for batch in candidates:  # DeepSpeed iterates a set: the tie rule makes the order irrelevant
        gpus = _valid_gpus(batch, micro_batches, min_gpus, max_gpus)
        better = prefer_larger and batch > best_batch or not prefer_larger and batch < best_batch
        if len(gpus) > best_count or (len(gpus) == best_count and better):
            best_count, best_gpus, best_batch = len(gpus), gpus, batch
    return best_batch, best_gpus


def _compatible_v01(micro_batches, cap, min_gpus=None, max_gpus=None, prefer_larger=True):
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or cap // min(micro_batches)
    if not all(m <= cap for m in micro_batches):
        raise ValueError(f"elasticity.micro_batch_sizes: every micro batch must be <= max_train_batch_size {cap} "
                         f"(got {micro_batches})")
    lcm = reduce(math.lcm, micro_batches)
    return _best(_candidate_batch_sizes(list(micro_batches) + [lcm], cap), micro_batches, min_gpus, max_gpus,
                 prefer_larger)


def _compatible_v02(micro_batches, cap, current_gpus, min_gpus, max_gpus, prefer_larger, gpus_per_node, mp_size):
    if gpus_per_node % mp_size:
        raise ElasticityError(f"elasticity.num_gpus_per_node: version 0.2 needs it divisible by "
                              f"elasticity.model_parallel_size {mp_size} (got {gpus_per_node})")

    def micro_for(batch):
        chosen = None
        for micro in micro_batches:
            if batch // current_gpus % micro == 0:
                if chosen is None or (prefer_larger and chosen < micro):
                    chosen = micro
        return chosen

    dp_per_node = gpus_per_node // mp_size
    batch, nodes = _compatible_v01(micro_batches, int(cap / dp_per_node), int(min_gpus / gpus_per_node),
                                   int(max_gpus / gpus_per_node), prefer_larger=prefer_larger)
    batch = int(batch) * dp_per_node
    valid = [n * dp_per_node for n in nodes]
    if current_gpus // mp_size in valid:
        return batch, valid, micro_for(batch)
    current_dp = (current_gpus / gpus_per_node) * dp_per_node
    candidates = [math.floor(cap / float(micro * current_dp)) * (micro * current_dp) for micro in micro_batches]
    batch = max(candidates) if prefer_larger else min(candidates)
    return batch, [int(current_dp)], micro_for(batch)


def _version_tuple(text: str) -> tuple:
    parts = []
    for piece in str(text).split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_scheduler_config(section: dict) -> None:
    """DeepSpeed's `ensure_immutable_elastic_config`: the scheduler's copy of the config (env
    ``DEEPSPEED_ELASTICITY_CONFIG``, when set) must agree on the batch cap, micro batches and version."""
    text = os.environ.get(SCHEDULER_CONFIG_ENV)
    if text is None:
        return
    seen = json.loads(text)
    seen = ElasticSettings(seen.get("elasticity", seen) if isinstance(seen, dict) else seen)
    ours = ElasticSettings(section)
    for key, attr in (("max_train_batch_size", "max_acceptable_batch_size"), ("micro_batch_sizes", "micro_batches"),
                      ("version", "version")):
        if getattr(ours, attr) != getattr(seen, attr):
            raise ElasticityConfigError(f"elasticity.{key}: the resource scheduler saw {getattr(seen, attr)!r} "
                                        f"(env {SCHEDULER_CONFIG_ENV}) but the runtime config has {getattr(ours, attr)!r}")


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False):
    """DeepSpeed's `deepspeed.elasticity.compute_elastic_config`: ``(final_batch_size, valid_gpus)``, or
    ``(final_batch_size, valid_gpus, micro_batch_size)`` when `world_size` > 0 (checked against the
    valid counts; the largest micro batch dividing the per-rank batch) or `return_microbatch`.
    Version 0.2 needs a world size: the argument, else env ``WORLD_SIZE``."""
    if not isinstance(ds_config, dict):
        raise ValueError(f"compute_elastic_config: ds_config must be a dict (got {type(ds_config).__name__})")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("elasticity: missing from the config; add it to run an elastic training job")
    section = ds_config["elasticity"]
    if not isinstance(section, dict) or not section.get("enabled", False):
        raise ElasticityConfigError("elasticity.enabled: elasticity is disabled; set it true for an elastic job")
    cfg = ElasticSettings(section)
    version = float(cfg.version)
    if cfg.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(f"elasticity.model_parallel_size: version {cfg.version} does not support model "
                                    f"parallelism (got {cfg.model_parallel_size}); use version 0.2")
    if version > LATEST_ELASTICITY_VERSION:
        raise ElasticityConfigError(f"elasticity.version: at most {LATEST_ELASTICITY_VERSION} (got {cfg.version})")
    if _version_tuple(target_deepspeed_version) < _version_tuple(MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(f"compute_elastic_config: target DeepSpeed version {target_deepspeed_version} is older "
                              f"than {MINIMUM_DEEPSPEED_VERSION}, the first with elasticity")
    micro = None
    if version == 0.1:
        batch, valid = _compatible_v01(cfg.micro_batches, cfg.max_acceptable_batch_size, cfg.min_gpus, cfg.max_gpus,
                                       cfg.prefer_larger_batch_size)
    elif version == 0.2:
        current = world_size
        if current == 0:
            env = os.environ.get("WORLD_SIZE")
            if env is None or not env.isnumeric():
                raise ElasticityConfigError(f"elasticity.version 0.2: needs the world size, as the world_size argument "
                                            f"or env WORLD_SIZE (got {env!r})")
            current = int(env)
        batch, valid, micro = _compatible_v02(cfg.micro_batches, cfg.max_acceptable_batch_size, current, cfg.min_gpus,
                                              cfg.max_gpus, cfg.prefer_larger_batch_size, cfg.num_gpus_per_node,
                                              cfg.model_parallel_size)
    else:
        raise NotImplementedError(f"elasticity.version: no elastic rule for version {cfg.version} (0.1 and 0.2 exist)")
    batch = int(batch)
    if world_size > 0:
        if world_size not in valid:
            raise ElasticityIncompatibleWorldSize(f"elasticity: world size {world_size} is not one of the valid GPU "
                                                  f"counts {valid} for batch size {batch}")
        return batch, valid, _largest_micro(batch, world_size, cfg.micro_batches)
    if return_microbatch:
        if version == 0.2:
            return batch, valid, micro
        raise ElasticityConfigError("compute_elastic_config(return_microbatch=True): version 0.1 picks the micro batch "
                                    "for a world size; pass world_size")
    return batch, valid


def _largest_micro(batch: int, world_size: int, micro_batches: list[int]) -> int:
    for micro in sorted(set(micro_batches), reverse=True):
        if batch // world_size % micro == 0:
            return micro
    raise ElasticityError(f"elasticity: no micro batch of {micro_batches} divides the per-rank batch "
                          f"{batch} // {world_size}")


def elasticity_enabled(ds_config: dict) -> bool:
    """DeepSpeed's `elasticity_enabled`: the section is present and `enabled` is set."""
    return bool(isinstance(ds_config.get("elasticity"), dict) and ds_config["elasticity"].get("enabled", False))


def elastic_batch(ds_config: dict[str, Any], world_size: int, version: Optional[str] = None) -> tuple[int, int, int]:
    """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`` at
    `world_size` data-parallel ranks, as DeepSpeed's config applies elasticity: batch keys set beside
    it are an error unless ``ignore_non_elastic_batch_info`` (then they are overridden)."""
    section = ds_config["elasticity"]
    batch, _, micro = compute_elastic_config(ds_config, version or "0.19.8", world_size=world_size)
    check_scheduler_config(section)
    if not section.get("ignore_non_elastic_batch_info", False):
        given = [key for key in BATCH_KEYS if key in ds_config]
        if given:
            raise ElasticityConfigError(
                f"elasticity: {', '.join(given)} set beside elastic training, which chooses the batch itself; remove "
                f"them, or set elasticity.ignore_non_elastic_batch_info true to have them ignored")
    return batch, micro, batch // (micro * world_size)


__all__ = ["ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize", "compute_elastic_config",
           "elastic_batch", "elasticity_enabled"]
