"""Named wall-clock timers (forward, backward, step, communication) for `wall_clock_breakdown`.

On CUDA a timer synchronizes the device at start and stop so the figures mean something; timers are
only created when the breakdown is requested, so the hot path pays nothing otherwise. Two windows are
kept: `elapsed_ms` (the log's, over the print interval) and `step_ms` (one optimizer step's, for the
monitor events and the flops profiler); reading one never resets the other.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from lightspeed._utils.device import synchronize


class Timers:
    def __init__(self, device: torch.device, enabled: bool):
        self.device = device
        self.enabled = enabled
        self._start: dict[str, float] = {}
        self._elapsed: dict[str, float] = defaultdict(float)
        self._step: dict[str, float] = defaultdict(float)

    def start(self, name: str) -> None:
        if self.enabled:
            synchronize(self.device)
            self._start[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._start:
            synchronize(self.device)
            self.add(name, time.perf_counter() - self._start.pop(name))

    def add(self, name: str, seconds: float) -> None:
        if self.enabled:
            self._elapsed[name] += seconds
            self._step[name] += seconds

    def elapsed_ms(self, reset: bool = True) -> dict[str, float]:
        out = {k: v * 1e3 for k, v in self._elapsed.items()}
        if reset:
            self._elapsed.clear()
        return out

    def step_ms(self) -> dict[str, float]:
        """Milliseconds per timer since the previous call (the engine calls it once per optimizer
        step); empty when the timers are off."""
        out = {k: v * 1e3 for k, v in self._step.items()}
        self._step.clear()
        return out


class ThroughputTimer:
    """DeepSpeed's `engine.tput_timer`: samples per second over the training steps after the first
    `start_step` (warm-up) ones. The engine calls `start()` when a forward begins and
    `stop(global_step=...)` at the end of every `step()`; the time between (forward, backward, step)
    is summed, as DeepSpeed's ThroughputTimer does, so data loading between micro-steps is excluded.

    `config` is the `timers.throughput` section: `enabled` false makes start/stop no-ops,
    `synchronized` waits for the device at both ends so the interval covers the queued kernels.
    Must not log: the engine's step line already reports samples/s (`report_speed` is accepted for
    DeepSpeed's signature and has no effect).
    """

    def __init__(self, config, batch_size: int | None, device: torch.device, start_step: int = 2):
        self.config = config
        self.device = device
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # seconds, over the steps after start_step
        self.step_elapsed_time = 0.0  # seconds, over the current optimizer step's micro-steps

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.config.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                synchronize(self.device)
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            if self.config.synchronized:
                synchronize(self.device)
            self.end_time = time.time()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """`batch_size` samples per optimizer step over the mean timed step; -inf before any step was
        timed (DeepSpeed's answer before the first step)."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed_steps)
