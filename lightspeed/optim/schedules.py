"""Learning-rate schedules with DeepSpeed's names, formulas, defaults and stepping contract, and
`build_scheduler()` for the ds_config `scheduler` section.

Owns: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, and the lookup of any other
name in torch.optim.lr_scheduler. Must not: step the optimizer or know about the engine.

Note [DeepSpeed stepping contract]: these are plain objects, not torch LRScheduler subclasses. They
count batches in `last_batch_iteration` (-1 = not started). Constructing with -1 writes the lr of
"iteration -1" into the optimizer: WarmupLR/WarmupDecayLR write warmup_min_lr, WarmupCosineLR
writes 0.0, LRRangeTest writes lr_range_test_min_lr, OneCycle writes cycle_min_lr (and betas
(cycle_min_mom, 0.99) when cycling momentum). `step(n=None)` sets the iteration to n (default: +1)
and writes `get_lr()` into every param group. `state_dict()` is {'last_batch_iteration': n};
`load_state_dict()` restores only that, the lr is rewritten at the next step(). `get_last_lr()`
raises until an lr was recorded (OneCycle records none at construction).

Note [per-group values]: as DeepSpeed (lr_schedules.py after its 2026 fixes): WarmupLR/WarmupDecayLR's
warmup_min_lr / warmup_max_lr, LRRangeTest's lr_range_test_min_lr and OneCycle's cycle_min_lr,
cycle_max_lr, cycle_min_mom and cycle_max_mom take one number for every param group or a list with
one per group (another length is a ValueError); WarmupLR without warmup_max_lr warms each group up to
that group's own lr. A group whose lr is a tensor (capturable or compiled optimizers) gets the new
value written into that tensor, so whoever holds it sees the change. Step sizes (warmup_num_steps,
lr_range_test_step_size, cycle_first/second_step_size) must be positive and decay_step_size >= 0:
ValueError otherwise, where zero would divide by zero or (warmup) DeepSpeed refuses it too.
"""

from __future__ import annotations

import inspect
import math
from typing import Annotated, Any

import torch
from pydantic import BeforeValidator, ValidationError, create_model

from lightspeed._utils.logging import get_logger
from lightspeed.config.base import Bool, Choice, Float, Int, NonNegInt, PosInt, Section, as_int, problems_from
from lightspeed.config.base import show, suggest
from lightspeed.config.errors import ConfigError

logger = get_logger(__name__)

__all__ = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_scheduler",
           "scheduled_steps"]

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def _torch_optimizer(optimizer):
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        return optimizer.optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def _update_lr(param_groups, lrs) -> list:
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):  # in place: a compiled or capturable step reads this very tensor
            group["lr"].fill_(float(lr))
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _per_group(optimizer, value, name: str) -> list:
    """`value` for every param group: a list/tuple with one per group, or one value for all."""
    num_groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(f"{name}: expected {num_groups} values (one per param group), got {len(value)}")
        return list(value)
    return [value] * num_groups


def _positive_step(value, name: str, allow_zero: bool = False):
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low or value != int(value):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Warm-up progress for 0 <= iteration < warmup_num_steps (which is >= 2)."""
    if warmup_type == WARMUP_LOG_RATE:
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


def _checked_warmup(warmup_num_steps, warmup_type) -> tuple[int, str]:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        logger.warning(f"Using unknown warmup_type: {warmup_type}. The increasing function is set to default (log)")
        warmup_type = WARMUP_LOG_RATE
    return max(2, warmup_num_steps), warmup_type


class _Schedule:
    """Stepping, get_last_lr and state_dict shared by the DeepSpeed schedules."""

    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = last_batch_iteration

    def get_lr(self) -> list:
        raise NotImplementedError

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = _update_lr(self.optimizer.param_groups, self.get_lr())

    def get_last_lr(self) -> list:
        """The lrs last written into the param groups, one per group."""
        if getattr(self, "_last_lr", None) is None:
            raise RuntimeError("need to call step() first")
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class LRRangeTest(_Schedule):
    """lr = min_lr * (1 + step_rate * x), x = (n+1) / step_size, floored when staircase."""

    def __init__(self, optimizer, lr_range_test_min_lr: float | list = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_step(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._last_lr = _update_lr(self.optimizer.param_groups, self.min_lr)

    def get_lr(self) -> list:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        increase = 1 + self.step_rate * (math.floor(interval) if self.staircase else interval)
        return [min_lr * increase for min_lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        super().step(batch_iteration)


class OneCycle(_Schedule):
    """1Cycle: lr rises min -> max over cycle_first_step_size batches, falls back over
    cycle_second_step_size, then decays every decay_step_size; Adam's beta1 moves inversely."""

    def __init__(self, optimizer, cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        self.first_step_size = float(_positive_step(cycle_first_step_size, "cycle_first_step_size"))
        second = cycle_second_step_size
        if second is not None:  # 0, as DeepSpeed allows: the cycle only rises, then the decay begins
            _positive_step(second, "cycle_second_step_size", allow_zero=True)
        _positive_step(decay_step_size, "decay_step_size", allow_zero=True)
        self.second_step_size = float(second) if second is not None else self.first_step_size
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        second_stairs = cycle_second_stair_count
        self.second_stair_count = cycle_first_stair_count if second_stairs is None else second_stairs
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)

        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        if last_batch_iteration == -1:
            _update_lr(groups, self.min_lrs)

        self.cycle_momentum = cycle_momentum
        if cycle_momentum and "betas" not in self.optimizer.defaults:
            logger.warning(f"cycle_momentum is disabled because optimizer {type(self.optimizer).__name__} "
                           "does not support momentum, no betas attribute in defaults")
            self.cycle_momentum = False
        if self.cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_moms = [(m, 0.99) for m in _per_group(self.optimizer, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in _per_group(self.optimizer, cycle_max_mom, "cycle_max_mom")]
            if last_batch_iteration == -1:
                for group, betas in zip(groups, self.min_moms):
                    group["betas"] = betas

    def _scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor, stair_count = x / self.step_ratio, self.first_stair_count
        else:
            scale_factor, stair_count = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stair_count > 0:
            # From the integer offset, not from scale_factor: float error at a half-cycle boundary
            # would floor a whole stair away (DeepSpeed quantises the same way).
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                position = cycle_iteration * stair_count / self.first_step_size
            else:
                position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(position) / stair_count
        return scale_factor

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        return [lo / (1 + self.decay_lr_rate * self._decay_interval()) for lo in self.min_lrs]

    def get_mom(self) -> list | None:
        """Per-group betas (cycled beta1, 0.99), or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [(beta1 * factor, beta2) for beta1, beta2 in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = betas


class WarmupLR(_Schedule):
    """lr = min + (max - min) * gamma, gamma = log(n+1)/log(W) ('log') or n/W ('linear') while n < W,
    then 1; W = max(2, warmup_num_steps). warmup_max_lr=None: each group's own lr at construction."""

    def __init__(self, optimizer, warmup_min_lr: float | list = 0.0, warmup_max_lr: float | list | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps, self.warmup_type = _checked_warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if last_batch_iteration == -1:
            self._last_lr = _update_lr(self.optimizer.param_groups, self.min_lrs)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            logger.warning("Attempting to get learning rate from scheduler before it has started")
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then gamma = max(0, (T - n) / max(1, T - W)) for n >= W, T = total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float | list = 0.0,
                 warmup_max_lr: float | list | None = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """lr = (group lr at construction) * ratio: warm-up from warmup_min_ratio to 1 over W batches,
    then a cosine down to cos_min_ratio at total_num_steps, held there afterwards."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        super().__init__(optimizer, last_batch_iteration)
        self.warmup_num_steps, self.warmup_type = _checked_warmup(warmup_num_steps, warmup_type)
        self.total_num_steps = total_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_min_ratio = warmup_min_ratio
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")
        self.org_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = _update_lr(self.optimizer.param_groups, [0.0] * len(self.org_lrs))

    def get_lr_ratio(self) -> float:
        n = self.last_batch_iteration
        if n < 0:
            return 0.0
        if n < self.warmup_num_steps:
            fraction = _warmup_fraction(n, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + fraction * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (n - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list:
        if self.last_batch_iteration < 0:
            logger.warning("Attempting to get learning rate from scheduler before it has started")
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


def scheduled_steps(scheduler) -> int | None:
    """The number of steps `scheduler` is laid out for, when it says: WarmupDecayLR's and
    WarmupCosineLR's total_num_steps, torch's OneCycleLR's total_steps; else None."""
    if isinstance(scheduler, (WarmupDecayLR, WarmupCosineLR)):
        return int(scheduler.total_num_steps)
    if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        return int(scheduler.total_steps)
    return None


# ----------------------------------------------------------------------------------------------
# The ds_config `scheduler` section (read_section / kwargs_problems also serve the optimizer factory)


def read_section(section_config, section: str) -> tuple[str, dict]:
    """(type, params) of a section given as an object with `.type`/`.params` or as a dict."""
    if isinstance(section_config, dict):
        type_name, params = section_config.get("type"), section_config.get("params")
    else:
        type_name, params = getattr(section_config, "type", None), getattr(section_config, "params", None)
    if not isinstance(type_name, str) or not type_name:
        raise ConfigError(f"{section}.type: must be a non-empty string (got {show(type_name)})")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{section}.params: must be an object (got {show(params)})")
    return type_name, dict(params or {})


def kwargs_problems(fn, params: dict, path: str, skip: tuple = ()) -> list[str]:
    """ConfigError lines for keys of `params` that `fn` does not take and required arguments missing."""
    signature = inspect.signature(fn)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {n: p for n, p in signature.parameters.items() if p.kind in kinds and n not in skip}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    problems = [] if takes_any else [f"{path}.{k}: unknown key{suggest(k, named)}" for k in params if k not in named]
    return problems + [f"{path}.{n}: is required" for n, p in named.items() if p.default is p.empty and n not in params]


def _lr_or_list(nullable: bool):
    expected = "must be a number >= 0 or a list of them, one per param group" + (", or null" if nullable else "")

    def is_lr(v) -> bool:
        return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0

    def check(value):
        if value is None and nullable:
            return None
        if is_lr(value):
            return float(value)
        if isinstance(value, list) and value and all(is_lr(v) for v in value):
            return [float(v) for v in value]
        raise ValueError(expected)

    return Annotated[Any, BeforeValidator(check)]


def _optional_int(ge: int | None = None):
    expected = "must be an integer" + (f" >= {ge}" if ge is not None else "") + " or null"

    def check(value):
        if value is not None and (as_int(value) is None or (ge is not None and as_int(value) < ge)):
            raise ValueError(expected)
        return None if value is None else as_int(value)

    return Annotated[Any, BeforeValidator(check)]


# Field type of every DeepSpeed schedule argument; which ones a schedule takes, their defaults and
# which are required come from its constructor's signature.
_PARAM_TYPES = {
    "warmup_min_lr": _lr_or_list(False), "warmup_max_lr": _lr_or_list(True), "warmup_num_steps": PosInt,
    "warmup_type": Choice(WARMUP_LOG_RATE, WARMUP_LINEAR_RATE), "total_num_steps": NonNegInt,
    "warmup_min_ratio": Float(ge=0), "cos_min_ratio": Float(ge=0),
    "cycle_min_lr": _lr_or_list(False), "cycle_max_lr": _lr_or_list(False), "decay_lr_rate": Float(ge=0),
    "cycle_first_step_size": PosInt, "cycle_second_step_size": _optional_int(0),
    "cycle_first_stair_count": Int(), "cycle_second_stair_count": _optional_int(),
    "decay_step_size": NonNegInt, "cycle_momentum": Bool,
    "cycle_min_mom": _lr_or_list(False), "cycle_max_mom": _lr_or_list(False),
    "decay_mom_rate": Float(ge=0),
    "lr_range_test_min_lr": _lr_or_list(False), "lr_range_test_step_size": PosInt,
    "lr_range_test_step_rate": Float(ge=0), "lr_range_test_staircase": Bool,
    "last_batch_iteration": Int(ge=-1),
}


def _params_model(cls) -> type[Section]:
    fields = {
        name: (_PARAM_TYPES[name], ... if p.default is p.empty else p.default)
        for name, p in inspect.signature(cls).parameters.items()
        if name != "optimizer"
    }
    return create_model(f"{cls.__name__}Params", __base__=Section, **fields)


_DEEPSPEED_SCHEDULES = {
    cls.__name__: (cls, _params_model(cls)) for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}


def _torch_schedule_names() -> list[str]:
    module = torch.optim.lr_scheduler
    bases = (module.LRScheduler, module.ReduceLROnPlateau)
    return [
        n for n in dir(module)
        if not n.startswith("_") and isinstance(getattr(module, n), type)
        and issubclass(getattr(module, n), bases) and getattr(module, n) is not module.LRScheduler
    ]


def build_scheduler(scheduler_config, optimizer):
    """The scheduler named by `scheduler_config` (`.type`/`.params`, or a dict) for `optimizer`.

    DeepSpeed's schedule names are matched exactly (case-sensitive, as in DeepSpeed); any other name
    is looked up in torch.optim.lr_scheduler. Unknown names and bad params raise ConfigError.
    """
    scheduler, description = make_scheduler(scheduler_config, optimizer)
    logger.info(f"LR scheduler: {description}")
    return scheduler


def make_scheduler(scheduler_config, optimizer) -> tuple[Any, str]:
    """`build_scheduler` without the log line: (scheduler, what was built)."""
    name, params = read_section(scheduler_config, "scheduler")
    if name in _DEEPSPEED_SCHEDULES:
        cls, model = _DEEPSPEED_SCHEDULES[name]
        try:
            values = model.model_validate(params).model_dump(exclude_unset=True)
        except ValidationError as error:
            raise ConfigError(problems_from(error, model, ("scheduler", "params"))) from None
        num_groups = len(_torch_optimizer(optimizer).param_groups)
        problems = [
            f"scheduler.params.{key}: must have one value per param group ({num_groups}) (got {show(value)})"
            for key, value in values.items()
            if isinstance(value, list) and len(value) != num_groups
        ]
        if problems:
            raise ConfigError(problems)
        try:
            return cls(optimizer, **values), f"{name} {values}"
        except ValueError as error:
            raise ConfigError(f"scheduler.params: {name} rejected them: {error}") from error

    torch_names = _torch_schedule_names()
    if name not in torch_names:
        known = list(_DEEPSPEED_SCHEDULES) + torch_names
        raise ConfigError(f"scheduler.type: unknown scheduler {show(name)}{suggest(name, known)}")
    cls = getattr(torch.optim.lr_scheduler, name)
    problems = kwargs_problems(cls, params, "scheduler.params", skip=("optimizer",))
    if problems:
        raise ConfigError(problems)
    try:
        scheduler = cls(_torch_optimizer(optimizer), **params)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"scheduler.params: torch.optim.lr_scheduler.{name} rejected them: {error}") from error
    return scheduler, f"torch.optim.lr_scheduler.{name} {params}"
