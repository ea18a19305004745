"""What one autotuning experiment measures inside the training script, and the file it reports to.

With ``autotuning.enabled`` the engine times the optimizer steps after ``start_profile_step`` up to
``end_profile_step + 1`` (DeepSpeed's window; the first step is never timed), writes the metrics as JSON on global rank 0, and ends the
process after step ``end_profile_step + 1``, as DeepSpeed's engine does: the script needs no change.
Owns `AutotuningProbe`. Must not choose configs or start processes (lightspeed.autotuning does).

Note: [the metric file]
    The path is ``autotuning.metric_path``, else env ``LIGHTSPEED_AUTOTUNING_METRIC_PATH`` (which the
    autotuner sets for each experiment), else ``./autotuning_metric.json`` (DeepSpeed's default). Keys:
    DeepSpeed's ``latency`` (ms per optimizer step), ``throughput`` (samples per second, all ranks) and
    ``FLOPS_per_gpu`` (3 x the forward's FLOPs, counted once with torch's FlopCounterMode in the step
    before the window, per micro step per second); and lightspeed's ``tokens_per_s`` (when the first tensor input of the forward is
    an integer tensor: its element count, the tokens of a micro batch, null otherwise),
    ``peak_memory_bytes`` (the accelerator's peak over the window), ``memory_breakdown`` (the engine's
    `memory_breakdown()`), ``activation_bytes`` (the bytes autograd saved for backward in one forward,
    counted with saved-tensor hooks; these counts are null for a compiled module) and the batch it ran. The autotuner's memory model is fitted to
    the last three (autotuning/memory.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional

import torch

from lightspeed._utils.accelerator import get_accelerator
from lightspeed._utils.logging import get_logger

logger = get_logger(__name__)

METRIC_PATH_ENV = "LIGHTSPEED_AUTOTUNING_METRIC_PATH"


def metric_path(config) -> str:
    """Where this process reports (Note: [the metric file])."""
    return config.autotuning.metric_path or os.environ.get(METRIC_PATH_ENV) or \
        os.path.join(os.getcwd(), "autotuning_metric.json")


class AutotuningProbe:
    """Measures the profile window of one experiment; `forward` wraps the engine's forward, `after_step`
    runs after each optimizer step and ends the process after the window."""

    def __init__(self, engine):
        self.engine = engine
        # the window: the steps after `start` up to `end + 1` (at least one step, none before the first)
        self.start = max(engine.config.autotuning.start_profile_step, 1)
        self.end = engine.config.autotuning.end_profile_step
        if self.end + 1 <= self.start:
            raise ValueError(f"autotuning.end_profile_step: must be >= 1 so that one step is timed "
                             f"(got {self.end})")
        self._t0: Optional[float] = None
        self._measured_forward = False
        self.fwd_flops: Optional[int] = None
        self.activation_bytes: Optional[int] = None
        self.tokens_per_micro: Optional[int] = None

    def forward(self, call, inputs: tuple, kwargs: dict):
        """Run `call()`; the first forward of the step before the window also counts FLOPs, saved bytes and
        tokens (outside the timed steps, as counting slows it; not with compiled regions, whose graphs the
        counters would break)."""
        if self._measured_forward or self.engine.global_steps < self.start - 1:
            return call()
        self._measured_forward = True
        if self.engine.is_compiled:
            return call()
        first = next((x for x in list(inputs) + list(kwargs.values()) if torch.is_tensor(x)), None)
        if first is not None and not first.is_floating_point() and not first.is_complex():
            self.tokens_per_micro = int(first.numel())
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False)
        with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call()
        self.fwd_flops = int(counter.get_total_flops())
        self.activation_bytes = saved[0]
        return out

    def after_step(self) -> None:
        steps = self.engine.global_steps
        if steps == self.start:
            _sync()
            get_accelerator().reset_peak_memory_stats()
            self._t0 = time.perf_counter()
        if steps != self.end + 1:
            return
        _sync()
        if self._t0 is None:
            raise RuntimeError(f"autotuning: the profile window started at step {self.start} was never reached")
        seconds = (time.perf_counter() - self._t0) / max(self.end + 1 - self.start, 1)
        self._report(seconds)
        logger.info("autotuning: profile window done (%.1f ms per step); exiting as DeepSpeed's engine does",
                    seconds * 1e3)
        sys.exit(0)

    def _report(self, seconds: float) -> None:
        engine = self.engine
        gas = engine.gradient_accumulation_steps()
        dp = engine.dp_world_size
        latency_ms = seconds * 1e3
        metrics: dict[str, Any] = {
            "latency": latency_ms,
            "throughput": engine.train_batch_size() / seconds,
            "FLOPS_per_gpu": None if self.fwd_flops is None else 3 * self.fwd_flops * gas / seconds,
            "tokens_per_s": None if self.tokens_per_micro is None else self.tokens_per_micro * gas * dp / seconds,
            "peak_memory_bytes": int(get_accelerator().max_memory_allocated()),
            "memory_breakdown": engine.memory_breakdown(),
            "activation_bytes": self.activation_bytes,
            "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": gas, "dp_world_size": dp,
            "zero_stage": engine.zero_optimization_stage(),
        }
        if engine.global_rank == 0:
            path = metric_path(engine.config)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(metrics, f)
            os.replace(tmp, path)
            logger.info("autotuning: wrote %s", path)


def _sync() -> None:
    get_accelerator().synchronize()
