"""`ZenFlowOptions`: DeepSpeed's ``zero_optimization.zenflow`` section, validated as DeepSpeed validates
it, and the schedule it resolves to (which steps select columns, which steps run the CPU update).

Owns: the keys, their defaults and their rules, and the step predicates. Must not: step or select
anything (offload/zenflow.py does).

DeepSpeed's keys and defaults:
    topk_ratio            0.1     fraction of each 2-D weight's columns updated on the device every step
    select_strategy       "auto"  "auto" (= "epoch" with select_interval 1), "step" or "epoch"
    select_interval       "auto"  steps (or epochs) between column selections; an int unless "auto"
    update_interval       "auto"  steps between the CPU updates of the other columns; "auto": adaptive
    full_warm_up_rounds   0       first steps that update every element (no selection)
    overlap_step          False   the CPU update runs in the background, one interval behind
    offload               False   the selected columns' Adam state in host memory, moved over per step
    auto_ratio            0.99    with update_interval "auto": the share of 2-D weights whose
                                  unselected gradient mass must catch up before an update
    pt_reserved_cores_perc 0.5    DeepSpeed's split of the cores between training and its optimizer
                                  process (no effect here: the background step is a thread of this
                                  process and the CPU kernels use torch's thread pool)
    steps_per_epoch       None    the "epoch" strategy's unit; DeepSpeed fills it from the training
                                  dataloader, as `initialize` does here

Note (the schedule, DeepSpeed's, counted in optimizer steps m = 0, 1, ...): with W warm-up rounds,
update interval U and resolved select interval S (S = 0: select once), step m updates every element
on the CPU when m + 1 < W, or (m + 1 - W) % U == 0, or S and (m + 1) % S == 0; it selects columns
when m >= W and (m == W or S and m % S == 0); from m = W on, every step updates the selected columns
on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightspeed.config.errors import ConfigError

KEY = "zero_optimization.zenflow"
STRATEGIES = ("auto", "step", "epoch")


def _ratio(d: dict, name: str, default: float) -> float:
    value = d.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{KEY}.{name}: must be a number in [0, 1] (got {value!r})")
    return float(value)


def _interval(d: dict, name: str) -> int | str:
    value = d.get(name, "auto")
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(f'{KEY}.{name}: a string must be "auto" (got {value!r})')
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f'{KEY}.{name}: must be "auto" or a non-negative integer (got {value!r})')
    return value


@dataclass(frozen=True)
class ZenFlowOptions:
    topk_ratio: float = 0.1
    select_strategy: str = "auto"
    select_interval: int | str = "auto"
    update_interval: int | str = "auto"
    full_warm_up_rounds: int = 0
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = 0.99
    pt_reserved_cores_perc: float = 0.5
    steps_per_epoch: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "ZenFlowOptions":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{KEY}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        strategy = d.get("select_strategy", "auto")
        if strategy not in STRATEGIES:
            raise ConfigError(f'{KEY}.select_strategy: must be one of "auto", "step", "epoch" (got {strategy!r})')
        warm = d.get("full_warm_up_rounds", 0)
        if isinstance(warm, bool) or not isinstance(warm, int) or warm < 0:
            raise ConfigError(f"{KEY}.full_warm_up_rounds: must be a non-negative integer (got {warm!r})")
        spe = d.get("steps_per_epoch")
        if spe is not None and (isinstance(spe, bool) or not isinstance(spe, int) or spe < 1):
            raise ConfigError(f"{KEY}.steps_per_epoch: must be a positive integer (got {spe!r})")
        flags = {}
        for name in ("overlap_step", "offload"):
            value = d.get(name, False)
            if not isinstance(value, bool):
                raise ConfigError(f"{KEY}.{name}: must be true or false (got {value!r})")
            flags[name] = value
        out = cls(topk_ratio=_ratio(d, "topk_ratio", 0.1), select_strategy=strategy,
                  select_interval=_interval(d, "select_interval"), update_interval=_interval(d, "update_interval"),
                  full_warm_up_rounds=warm, auto_ratio=_ratio(d, "auto_ratio", 0.99),
                  pt_reserved_cores_perc=_ratio(d, "pt_reserved_cores_perc", 0.5), steps_per_epoch=spe, **flags)
        # DeepSpeed's configure step: these combinations raise there too
        if strategy == "auto" and isinstance(out.select_interval, int):
            raise ConfigError(f'{KEY}.select_interval: the "auto" select_strategy selects once per epoch; leave '
                              f'select_interval "auto" or choose select_strategy "step" or "epoch"')
        if strategy != "auto" and isinstance(out.select_interval, str):
            raise ConfigError(f'{KEY}.select_interval: must be a number with select_strategy "{strategy}"')
        if out.update_interval == 0:
            raise ConfigError(f"{KEY}.update_interval: must be at least 1")
        out.schedule(out.steps_per_epoch)  # the interval rule, when it can be checked now
        return out

    @property
    def auto_update(self) -> bool:
        return isinstance(self.update_interval, str)

    def schedule(self, steps_per_epoch: int | None) -> "Schedule":
        """The resolved intervals (`steps_per_epoch`: the "epoch" strategy's unit, None when unknown)."""
        if self.select_strategy == "auto":
            strategy, interval = "epoch", 1
        else:
            strategy, interval = self.select_strategy, int(self.select_interval)
        if strategy == "epoch":
            interval = interval * steps_per_epoch if steps_per_epoch else 0
        update = 0 if self.auto_update else int(self.update_interval)
        if not self.auto_update and interval and interval < update:
            raise ConfigError(f"{KEY}.select_interval: the resolved select interval ({interval} steps) must be at "
                              f"least update_interval ({update})")
        return Schedule(interval, update, self.full_warm_up_rounds)


@dataclass(frozen=True)
class Schedule:
    select_interval: int  # 0: select once, at step full_warm_up_rounds
    update_interval: int  # 0: adaptive ("auto")
    warm_up: int

    def selects(self, m: int) -> bool:
        w, s = self.warm_up, self.select_interval
        return m >= w and (m == w or (s != 0 and m % s == 0))

    def updates(self, m: int, flagged: bool = False) -> bool:
        """Whether step `m` runs the CPU update; `flagged`: the adaptive rule asked for one."""
        w, s, u = self.warm_up, self.select_interval, self.update_interval
        if s != 0 and (m + 1) % s == 0:
            return True
        if u == 0:
            return m + 1 <= w or flagged
        return m + 1 < w or (m + 1 - w) % u == 0
