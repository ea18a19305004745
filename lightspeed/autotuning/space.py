"""The autotuner's search space: which configs are candidates, and each candidate's ds_config.

Owns `Candidate`, `Space` and `space_from_config`. Must not run anything or predict memory.

Note: [dimensions]
    As in DeepSpeed, a list in the user's ds_config where a value is expected is a dimension to tune,
    and ``zero_optimization.stage`` may be ``"all"`` (0-3); unset, the stage is DeepSpeed's 0. Tunable:
    ``zero_optimization.stage``, ``zero_optimization.offload_optimizer.device`` (``["none", "cpu"]``),
    ``compile.enabled`` (``[false, true]``: `engine.compile` at initialize) and
    ``gradient_accumulation_steps``. Activation checkpointing is the script's: it is tuned (off, on)
    when ``autotuning.arg_mappings`` maps ``"activation_checkpointing"`` to a script flag, passed when on.
    Micro batches: the powers of two from ``min_train_micro_batch_size_per_gpu`` up to
    ``max_train_micro_batch_size_per_gpu`` (both included), capped so that micro x dp stays within
    ``autotuning.max_train_batch_size``; the memory model keeps the ``num_tuning_micro_batch_sizes``
    largest that fit. A fixed ``train_batch_size`` fixes the accumulation: ``train // (micro x dp)``,
    and micro batches that do not divide it are not candidates.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any, Optional

from lightspeed.config.errors import ConfigError

CKPT_MAPPING = "activation_checkpointing"


@dataclass(frozen=True)
class Family:
    """Everything of a candidate but its batch: one memory calibration covers a family's activations."""

    stage: int
    offload: bool
    compile: bool
    ckpt: bool

    @property
    def name(self) -> str:
        return f"z{self.stage}" + ("_offload" if self.offload else "") + ("_compile" if self.compile else "") + \
            ("_ckpt" if self.ckpt else "")


@dataclass(frozen=True)
class Candidate:
    family: Family
    micro: int
    gas: int

    @property
    def name(self) -> str:
        return f"{self.family.name}_mb{self.micro}_gas{self.gas}"

    def describe(self) -> str:
        f = self.family
        return (f"stage {f.stage}, micro {self.micro}, gas {self.gas}, offload {'cpu' if f.offload else 'none'}, "
                f"ckpt {'on' if f.ckpt else 'off'}, compile {'on' if f.compile else 'off'}")


@dataclass
class Space:
    base: dict[str, Any]  # the user's ds_config, lists and "all" still in it
    families: list[Family]
    micro_grid: list[int]
    gas_values: Optional[list[int]]  # None: derived from train_batch_size or max_train_batch_size
    dp: int
    fixed_train_batch: Optional[int]
    max_train_batch: Optional[int]
    ckpt_flag: Optional[str]

    def gas_for(self, micro: int) -> list[int]:
        """The accumulation steps tried with `micro` (empty: `micro` is no candidate)."""
        if self.fixed_train_batch is not None:
            per = micro * self.dp
            return [self.fixed_train_batch // per] if self.fixed_train_batch % per == 0 else []
        if self.gas_values is not None:
            cap = self.max_train_batch
            return [g for g in self.gas_values if cap is None or micro * g * self.dp <= cap]
        if self.max_train_batch is not None:  # DeepSpeed: accumulate up to max_train_batch_size
            return [max(self.max_train_batch // (micro * self.dp), 1)]
        return [1]

    def candidates(self, family: Family, micros: list[int]) -> list[Candidate]:
        return [Candidate(family, m, g) for m in micros for g in self.gas_for(m)]

    def ds_config(self, cand: Candidate, experiment: bool, start: int, end: int) -> dict[str, Any]:
        """The ds_config one experiment (`experiment`: profile steps `start`..`end`, then exit) or the final
        run trains with."""
        cfg = copy.deepcopy(self.base)
        zero = cfg.setdefault("zero_optimization", {})
        zero["stage"] = cand.family.stage
        if cand.family.offload:
            zero["offload_optimizer"] = {**_dict(zero.get("offload_optimizer")), "device": "cpu"}
        elif "offload_optimizer" in zero:
            zero["offload_optimizer"] = {**_dict(zero["offload_optimizer"]), "device": "none"}
        compile_section = cfg.setdefault("compile", {})
        compile_section["enabled"] = cand.family.compile
        cfg["train_micro_batch_size_per_gpu"] = cand.micro
        cfg["gradient_accumulation_steps"] = cand.gas
        cfg["train_batch_size"] = cand.micro * cand.gas * self.dp
        tuning = {k: v for k, v in _dict(cfg.get("autotuning")).items() if k != "metric_path"}
        if experiment:  # the metric file is named by the environment (runtime/autotuning_probe.py)
            tuning.update(enabled=True, start_profile_step=start, end_profile_step=end)
        else:
            tuning["enabled"] = False
        cfg["autotuning"] = tuning
        return cfg

    def script_args(self, cand: Candidate) -> list[str]:
        return [self.ckpt_flag] if cand.family.ckpt and self.ckpt_flag else []


def _dict(value) -> dict:
    return dict(value) if isinstance(value, dict) else {}


def _choices(value, default: list, key: str, allowed: tuple) -> list:
    values = value if isinstance(value, list) else default if value is None else [value]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ConfigError(f"{key}: autotuning tries the values {list(allowed)} (got {value!r})")
    return list(dict.fromkeys(values))


def _powers_of_two(low: int, high: int) -> list[int]:
    out, m = [], low
    while m <= high:
        out.append(m)
        m *= 2
    if out and out[-1] != high and high > low:
        out.append(high)
    return out


def space_from_config(user: dict[str, Any], dp: int) -> Space:
    """The space of `user` (a ds_config dict with an ``autotuning`` section) at `dp` data-parallel ranks."""
    tuning = _dict(user.get("autotuning"))
    zero = _dict(user.get("zero_optimization"))
    stage = zero.get("stage", 0)
    stages = [0, 1, 2, 3] if stage == "all" or (isinstance(stage, list) and "all" in stage) else \
        _choices(stage, [0], "zero_optimization.stage", (0, 1, 2, 3))
    device = _dict(zero.get("offload_optimizer")).get("device")
    offloads = [d == "cpu" for d in _choices(device, ["none"], "zero_optimization.offload_optimizer.device",
                                             ("none", "cpu", None))]
    compiles = _choices(_dict(user.get("compile")).get("enabled"), [False], "compile.enabled", (False, True))
    mappings = _dict(tuning.get("arg_mappings"))
    ckpt_flag = mappings.get(CKPT_MAPPING)
    ckpts = [False, True] if ckpt_flag else [False]
    families = [Family(s, o, c, k) for s, o, c, k in itertools.product(stages, offloads, compiles, ckpts)
                if not (o and s == 0)]  # offload needs a ZeRO optimizer (stage >= 1)
    if not families:
        raise ConfigError("zero_optimization.offload_optimizer.device: offload needs stage >= 1; the space is empty")
    low = int(tuning.get("min_train_micro_batch_size_per_gpu", 1))
    high = int(tuning.get("max_train_micro_batch_size_per_gpu", 1024))
    max_train = tuning.get("max_train_batch_size")
    if max_train:  # DeepSpeed's: max_train_batch_size * mp_size // GPUs, GPUs being dp * mp_size
        high = min(high, max(int(max_train) // dp, 1))
    if high < low:
        raise ConfigError(f"autotuning.max_train_micro_batch_size_per_gpu: must be >= "
                          f"min_train_micro_batch_size_per_gpu {low} (got {high})")
    gas = user.get("gradient_accumulation_steps")
    gas_values = gas if isinstance(gas, list) else None
    fixed = user.get("train_batch_size") if isinstance(user.get("train_batch_size"), int) else None
    if gas_values is None and isinstance(gas, int) and fixed is None:
        gas_values = [gas]
    return Space(base=user, families=families, micro_grid=_powers_of_two(low, high), gas_values=gas_values, dp=dp,
                 fixed_train_batch=fixed, max_train_batch=int(max_train) if max_train else None, ckpt_flag=ckpt_flag)
