"""`StepProfiler`: the `flops_profiler` config block applied to training, as DeepSpeed's engine does.

Built by `initialize()` and handed to the engine, which calls `after_step` once per optimizer step
and knows nothing else about profiling. On global rank 0, with the block enabled, the profile starts
when step `profile_step` (0-based, DeepSpeed's count of finished steps) is about to run and is
printed (logged, or written to `output_file`) and ended after that step. *Changed* from DeepSpeed,
which restarts the count at each forward and so reports the last micro-batch only: every forward of
the profiled step is counted, so the flops, the forward latency and the engine's backward and step
timers all cover the same work (the same figures when there is no gradient accumulation).
"""

from __future__ import annotations

from typing import Mapping

import torch

from lightspeed.profiling.flops_profiler.profiler import FlopsProfiler, emit_profile


class StepProfiler:
    """`config` is the `flops_profiler` section; `run` the world and batch sizes printed with it."""

    def __init__(self, config, model: torch.nn.Module, *, rank: int, run: Mapping[str, int] | None = None):
        self.config = config
        self.active = bool(config.enabled) and rank == 0
        self.run = dict(run or {})
        self.profiler = (FlopsProfiler(model, recompute_fwd_factor=config.recompute_fwd_factor)
                         if config.enabled else None)
        if self.active and config.profile_step == 0:
            self.profiler.start_profile()

    def after_step(self, global_steps: int, step_ms: Mapping[str, float]) -> None:
        """`global_steps`: optimizer steps finished, this one included; `step_ms`: its timers."""
        if not self.active:
            return
        cfg = self.config
        # >=: a checkpoint loaded after the start moves the step count past profile_step + 1
        if self.profiler.started and global_steps >= cfg.profile_step + 1:
            text = self.profiler.profile_text(profile_step=global_steps, module_depth=cfg.module_depth,
                                              top_modules=cfg.top_modules, detailed=cfg.detailed,
                                              step_times_ms=dict(step_ms), run=self.run)
            emit_profile(text, cfg.output_file)
            self.profiler.end_profile()
        elif global_steps == cfg.profile_step:
            self.profiler.start_profile()
