"""Shared benchmark harness: timing with warm-up and device synchronisation, peak memory, tables.

Benchmarks are scripts, never tests; each prints its baseline measured in the same run.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

H200_BF16_PEAK_FLOPS = 989.4e12  # dense bf16 tensor-core peak of an H100/H200 SXM (for MFU)


@dataclass
class Result:
    name: str
    ms_per_step: float = float("nan")
    tokens_per_s: float = float("nan")
    peak_gib: float = float("nan")
    mfu: float = float("nan")
    losses: list[float] = field(default_factory=list)
    note: str = ""


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def time_steps(step, num_steps: int, warmup: int, repeats: int = 1) -> tuple[float, list[float]]:
    """Run `step() -> loss tensor` warmup + repeats x num_steps times; returns (ms per step of the timed
    window, its median over `repeats` windows, and every loss). One window is timed as a whole (no
    synchronization between its steps); more than one guards against a stray slow window."""
    losses = []
    for _ in range(warmup):
        losses.append(float(step()))
    windows = []
    for _ in range(max(repeats, 1)):
        sync()
        t0 = time.perf_counter()
        pending = [step() for _ in range(num_steps)]
        sync()
        windows.append((time.perf_counter() - t0) * 1e3 / max(num_steps, 1))
        losses += [float(x) for x in pending]
    return sorted(windows)[len(windows) // 2], losses


def print_table(results: list[Result], baseline: str) -> None:
    base = next((r for r in results if r.name == baseline), None)
    print(f"{'run':<28}{'ms/step':>10}{'vs base':>9}{'tokens/s':>12}{'MFU':>7}{'peak GiB':>10}  note")
    for r in results:
        ratio = r.ms_per_step / base.ms_per_step if base and base.ms_per_step == base.ms_per_step else float("nan")
        print(f"{r.name:<28}{r.ms_per_step:>10.1f}{ratio:>9.2f}{r.tokens_per_s:>12.0f}{r.mfu:>7.3f}"
              f"{r.peak_gib:>10.2f}  {r.note}")
