"""Loss scalers for fp16 training: a static scale, and DeepSpeed's dynamic scale with hysteresis.

Owns the scale and its update rule. It must not look at gradients (precision/overflow.py does) or talk
to other ranks: the caller passes an overflow flag that is already agreed across ranks, so every rank
makes the same update. State is plain Python numbers, so a checkpoint holding it loads under
``torch.load(weights_only=True)``.

Note: [DeepSpeed's update rule, kept exactly]
    ``update_scale(overflow)`` is DeepSpeed's ``DynamicLossScaler.update_scale`` (ZeRO 1/2/3 path):
    an overflow first spends hysteresis (``delayed_shift``), and only when one unit is left does it
    cut the scale, ``max(scale / factor, min_scale)``; hysteresis is *not* refilled by the cut. A good
    step refills it when ``consecutive_hysteresis`` is on. The scale grows by ``scale_factor`` when
    ``stable = cur_iter - last_overflow_iter - 1`` is a positive multiple of ``scale_window``, which
    refills hysteresis too. ``stable`` counts good steps *before* the current one, so the first growth
    happens on the (window + 1)-th consecutive good step, then every ``window`` steps. Reaching for a
    cut while already at ``min_scale`` raises when ``raise_error_at_min_scale`` (DeepSpeed's default
    for the class and hence for ZeRO, whose fp16 config never passes the flag); otherwise the scale
    stays at the floor and steps keep being skipped. (DeepSpeed's stage-0 FP16_Optimizer carries its
    own copy of this rule without hysteresis that never raises; `build_loss_scaler(stage0=True)` is it.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lightspeed._utils.logging import get_logger, warn_once
from lightspeed.config.errors import ConfigError

__all__ = ["MinLossScaleError", "StaticLossScaler", "DynamicLossScaler", "build_loss_scaler"]

logger = get_logger(__name__)


class MinLossScaleError(RuntimeError):
    """An overflow arrived with the dynamic loss scale already at ``min_scale``."""


def _fmt(scale: float) -> str:
    return str(int(scale)) if float(scale).is_integer() else repr(float(scale))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class _LossScaler:
    dynamic = False

    def __init__(self, scale: float):
        self.cur_scale = float(scale)
        self.cur_iter = 0
        self.num_overflows = 0

    @property
    def loss_scale(self) -> float:
        """The scale the next backward pass multiplies the loss by."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``; an fp16/bf16 loss is upcast to fp32 first so the product cannot overflow."""
        if self.cur_scale == 1.0:
            return loss
        if isinstance(loss, torch.Tensor) and loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        return loss * self.cur_scale

    def _log_overflow(self, message: str) -> None:
        # One line per overflow at DEBUG; INFO only at overflow 1, 2, 4, 8, ... so a run that keeps
        # overflowing does not flood the log.
        self.num_overflows += 1
        n = self.num_overflows
        if _is_pow2(n):
            logger.info(f"{message} [overflow {n} in {self.cur_iter + 1} steps; next report at overflow {2 * n}]")
        else:
            logger.debug(message)

    def _load_kind(self, state: Mapping[str, Any]) -> bool:
        if bool(state.get("dynamic_loss_scale", False)) != self.dynamic:
            saved, wanted = ("static", "dynamic") if self.dynamic else ("dynamic", "static")
            warn_once(f"loss scaler: the checkpoint holds a {saved} loss scaler but the config asks for a {wanted} "
                      "one; keeping the configured scaler with fresh state", logger)
            return False
        return True


class StaticLossScaler(_LossScaler):
    """A fixed loss scale (``fp16.loss_scale > 0``; 1.0 when fp16 is off). Overflowing steps are still
    skipped by the caller; ``update_scale`` only counts and reports them."""

    def __init__(self, scale: float = 1.0):
        scale = float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"StaticLossScaler: scale must be a finite number > 0 (got {scale})")
        super().__init__(scale)

    def update_scale(self, overflow: bool | torch.Tensor) -> None:
        """Record one optimizer step; ``overflow`` is the cross-rank flag (bool or 0-dim tensor)."""
        if bool(overflow):
            self._log_overflow(f"OVERFLOW! Skipping step. Static loss scale: {_fmt(self.cur_scale)}")
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers only."""
        return {"dynamic_loss_scale": False, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
                "num_overflows": self.num_overflows}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not self._load_kind(state):
            return
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state.get("cur_iter", 0))
        self.num_overflows = int(state.get("num_overflows", 0))


class DynamicLossScaler(_LossScaler):
    """DeepSpeed's dynamic loss scaler (see the Note in this module for the exact rule).

    ``delayed_shift`` is the ds_config ``fp16.hysteresis``: how many overflows are absorbed before
    the scale is cut.
    """

    dynamic = True

    def __init__(self, init_scale: float = 2**16, scale_factor: float = 2.0, scale_window: int = 1000,
                 min_scale: float = 1, delayed_shift: int = 2, consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = True):
        problems = []
        for name, value in (("init_scale", init_scale), ("min_scale", min_scale)):
            if isinstance(value, bool) or not (math.isfinite(float(value)) and float(value) > 0):
                problems.append(f"{name} must be a finite number > 0 (got {value!r})")
        if isinstance(scale_factor, bool) or not (math.isfinite(float(scale_factor)) and float(scale_factor) > 1):
            problems.append(f"scale_factor must be a finite number > 1 (got {scale_factor!r})")
        for name, value in (("scale_window", scale_window), ("delayed_shift", delayed_shift)):
            if isinstance(value, bool) or int(value) != value or value < 1:
                problems.append(f"{name} must be an integer >= 1 (got {value!r})")
        if problems:
            raise ValueError("DynamicLossScaler: " + "; ".join(problems))
        super().__init__(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.cur_hysteresis = self.delayed_shift
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.last_overflow_iter = -1

    def update_scale(self, overflow: bool | torch.Tensor) -> None:
        """Advance one optimizer step; ``overflow`` is the cross-rank flag (bool or 0-dim tensor)."""
        if bool(overflow):
            attempted = _fmt(self.cur_scale)
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise MinLossScaleError(
                        "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run. "
                        f"(loss scale {attempted} == fp16.min_loss_scale after {self.num_overflows} overflows "
                        f"in {self.cur_iter} steps; the gradients keep overflowing)")
                next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                self._log_overflow(f"OVERFLOW! Skipping step. Attempted loss scale: {attempted}, "
                                   f"reducing to {_fmt(next_scale)}")
                self.cur_scale = next_scale
            else:
                self._log_overflow(f"OVERFLOW! Skipping step. Attempted loss scale: {attempted}, but hysteresis "
                                   f"is {self.cur_hysteresis}. Reducing hysteresis to {self.cur_hysteresis - 1}")
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = self.cur_iter - self.last_overflow_iter - 1
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                logger.debug(f"No overflow for {stable_interval} steps; loss scale {_fmt(self.cur_scale)} -> "
                             f"{_fmt(self.cur_scale * self.scale_factor)}")
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers only; key names follow DeepSpeed's FP16_Optimizer state where they exist."""
        return {
            "dynamic_loss_scale": True, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter, "scale_factor": self.scale_factor,
            "scale_window": self.scale_window, "cur_hysteresis": self.cur_hysteresis,
            "min_scale": self.min_scale, "delayed_shift": self.delayed_shift,
            "consecutive_hysteresis": self.consecutive_hysteresis, "num_overflows": self.num_overflows,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore counters and settings. As in DeepSpeed (which restores the pickled scaler, or
        scale_factor/scale_window for FP16_Optimizer) the checkpoint's settings win over the config."""
        if not self._load_kind(state):
            return
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        self.scale_factor = float(state.get("scale_factor", self.scale_factor))
        self.scale_window = int(state.get("scale_window", self.scale_window))
        self.min_scale = float(state.get("min_scale", self.min_scale))
        self.delayed_shift = int(state.get("delayed_shift", self.delayed_shift))
        self.consecutive_hysteresis = bool(state.get("consecutive_hysteresis", self.consecutive_hysteresis))
        self.cur_hysteresis = int(state.get("cur_hysteresis", self.delayed_shift))
        self.num_overflows = int(state.get("num_overflows", 0))


def _field(cfg: Any, name: str, default: Any) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def build_loss_scaler(fp16_config: Any, *, raise_error_at_min_scale: bool | None = None, stage0: bool = False
                      ) -> StaticLossScaler | DynamicLossScaler:
    """The scaler a ds_config ``fp16`` section asks for (an object with the fields as attributes, a
    dict, or None). Disabled fp16 -> ``StaticLossScaler(1.0)``; ``loss_scale > 0`` -> static;
    ``loss_scale == 0`` -> dynamic from ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
    ``consecutive_hysteresis``, ``min_loss_scale``. ``raise_error_at_min_scale``: None reads the
    section's field of that name if it has one, else True (DeepSpeed's ZeRO behaviour). ``stage0``: the
    rule of DeepSpeed's stage-0 fp16 optimizers (FP16_Optimizer, FP16_UnfusedOptimizer), which keep
    their own copy of it without hysteresis and never raise at the floor: every overflow halves the
    scale (``hysteresis`` and ``raise_error_at_min_scale`` are not read).
    """
    if not _field(fp16_config, "enabled", False):
        return StaticLossScaler(1.0)
    loss_scale = _field(fp16_config, "loss_scale", 0)
    power = _field(fp16_config, "initial_scale_power", 16)
    window = _field(fp16_config, "loss_scale_window", 1000)
    hysteresis = _field(fp16_config, "hysteresis", 2)
    min_scale = _field(fp16_config, "min_loss_scale", 1)
    problems = []
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) \
            or not math.isfinite(loss_scale) or loss_scale < 0:
        problems.append(f"fp16.loss_scale: must be a finite number >= 0, 0 for dynamic scaling (got {loss_scale!r})")
    elif loss_scale > 0:
        return StaticLossScaler(float(loss_scale))
    if isinstance(power, bool) or not isinstance(power, int) or not -126 <= power <= 127:
        problems.append(f"fp16.initial_scale_power: must be an integer in [-126, 127] (got {power!r})")
    for key, value in (("loss_scale_window", window), ("hysteresis", hysteresis)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"fp16.{key}: must be an integer >= 1 (got {value!r})")
    if isinstance(min_scale, bool) or not isinstance(min_scale, (int, float)) \
            or not math.isfinite(min_scale) or min_scale <= 0:
        problems.append(f"fp16.min_loss_scale: must be a finite number > 0 (got {min_scale!r})")
    if problems:
        raise ConfigError(problems)
    if stage0:
        hysteresis, raise_error_at_min_scale = 1, False
    if raise_error_at_min_scale is None:
        raise_error_at_min_scale = bool(_field(fp16_config, "raise_error_at_min_scale", True))
    return DynamicLossScaler(init_scale=2.0**power, scale_factor=2.0, scale_window=window, min_scale=min_scale,
                             delayed_shift=hysteresis,
                             consecutive_hysteresis=bool(_field(fp16_config, "consecutive_hysteresis", False)),
                             raise_error_at_min_scale=raise_error_at_min_scale)
