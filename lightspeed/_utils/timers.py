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
