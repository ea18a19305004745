"""`MonitorMaster`: the backends a config enables, written by global rank 0 only, and the events the
engine reports after each optimizer step.

Built once by `initialize()` and handed to the engine as `engine.monitor`; the engine calls
`record_loss` from backward and `after_step` after each optimizer step, and knows nothing else about
monitoring. Must not: pick the rank itself when `initialize()` gives one, nor touch the engine.

Note: the engine's events (DeepSpeed's names and x-axis; the x-axis is the global sample count):

- `Train/Samples/train_loss`: the mean loss of the accumulation window's micro-batches on rank 0, at
  the sample count before the step's batch (DeepSpeed writes it from backward, before the step
  counts the batch; *changed*: DeepSpeed's value is the sum of the losses it backpropagated, which
  is this mean unless backward is called with scale_wrt_gas=False);
- `Train/Samples/lr` (the first param group's) and, with fp16, `Train/Samples/loss_scale`, at the
  count after the step;
- with `wall_clock_breakdown` (or `flops_profiler.enabled`, which turns the timers on), the step's
  `Train/Samples/elapsed_time_ms_{forward,backward,backward_inner,backward_allreduce,step}`:
  backward is the whole backward including the wait for gradient reduction, backward_inner the
  autograd pass alone, backward_allreduce the wait. Written in this order, so a backend that wants
  non-decreasing steps (wandb) keeps them all.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from lightspeed._utils.logging import current_rank
from lightspeed.monitor.base import Event, Monitor, require_package

TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
TIMER_EVENTS = {  # event name -> the engine timers (lightspeed._utils.timers names) it sums
    "Train/Samples/elapsed_time_ms_forward": ("forward",),
    "Train/Samples/elapsed_time_ms_backward": ("backward", "comm"),
    "Train/Samples/elapsed_time_ms_backward_inner": ("backward",),
    "Train/Samples/elapsed_time_ms_backward_allreduce": ("comm",),
    "Train/Samples/elapsed_time_ms_step": ("step",),
}

# config section -> (module to import, pip package): checked on every rank so a missing library fails
# the whole job at initialize, not rank 0 alone
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "comet": ("comet_ml", "comet_ml"), "csv_monitor": None}


def _build(section: str, section_config) -> Monitor:
    if section == "tensorboard":
        from lightspeed.monitor.tensorboard import TensorBoardMonitor

        return TensorBoardMonitor(section_config)
    if section == "wandb":
        from lightspeed.monitor.wandb import WandbMonitor

        return WandbMonitor(section_config)
    if section == "csv_monitor":
        from lightspeed.monitor.csv_monitor import CSVMonitor

        return CSVMonitor(section_config)
    from lightspeed.monitor.comet import CometMonitor

    return CometMonitor(section_config)


class MonitorMaster(Monitor):
    """Every backend `monitor_config` enables (`tensorboard`, `wandb`, `csv_monitor`, `comet`:
    any object with those sections, such as the whole `LightspeedConfig`). Backends are built, and
    events written, on global rank `rank == 0` only (`rank` defaults to this process's rank)."""

    def __init__(self, monitor_config: Any, rank: int | None = None):
        self.monitor_config = monitor_config
        self.rank = current_rank() if rank is None else rank
        sections = {name: getattr(monitor_config, name, None) for name in _PACKAGES}
        enabled = [name for name, section in sections.items() if section is not None and section.enabled]
        self.enabled = bool(enabled)
        for name in enabled:
            if _PACKAGES[name] is not None:
                require_package(_PACKAGES[name][0], name, _PACKAGES[name][1])
        self.monitors: dict[str, Monitor] = {}
        if self.rank == 0:
            for name in enabled:
                self.monitors[name] = _build(name, sections[name])
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._loss_samples = 0

    # DeepSpeed's attribute names for the backends
    @property
    def tb_monitor(self) -> Monitor | None:
        return self.monitors.get("tensorboard")

    @property
    def wandb_monitor(self) -> Monitor | None:
        return self.monitors.get("wandb")

    @property
    def csv_monitor(self) -> Monitor | None:
        return self.monitors.get("csv_monitor")

    @property
    def comet_monitor(self) -> Monitor | None:
        return self.monitors.get("comet")

    @property
    def active(self) -> bool:
        """True on the rank that writes, when some backend is enabled."""
        return bool(self.monitors)

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Write `[(name, value, step), ...]` to every backend (rank 0; a no-op elsewhere)."""
        if not self.monitors:
            return
        events = [(str(name), float(value), int(step)) for name, value, step in event_list]
        for monitor in self.monitors.values():
            monitor.write_events(events)

    def update_config(self, config_dict: dict) -> None:
        for monitor in self.monitors.values():
            monitor.update_config(config_dict)

    def close(self) -> None:
        """Flush and close every backend (ends the wandb run and the comet experiment)."""
        for monitor in self.monitors.values():
            monitor.close()
        self.monitors = {}

    # ------------------------------------------------------------------ the engine's events
    def record_loss(self, loss: torch.Tensor, global_samples: int) -> None:
        """One micro-batch's detached scalar loss (called from engine.backward)."""
        if not self.monitors:
            return
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1
        self._loss_samples = global_samples

    def after_step(self, *, global_samples: int, lr: Sequence[float], loss_scale: float | None,
                   step_ms: Mapping[str, float]) -> None:
        """Write the events of the optimizer step that just ended (see the Note above)."""
        if not self.monitors:
            return
        events = []
        if self._loss_count:
            events.append((TRAIN_LOSS, float(self._loss_sum) / self._loss_count, self._loss_samples))
        self._loss_sum, self._loss_count = None, 0
        if lr:
            events.append((LR, lr[0], global_samples))
        if loss_scale is not None:
            events.append((LOSS_SCALE, loss_scale, global_samples))
        if step_ms:
            events.extend((name, sum(step_ms.get(t, 0.0) for t in timers), global_samples)
                          for name, timers in TIMER_EVENTS.items())
        self.write_events(events)
