"""Shared benchmark harness: timing with warm-up and device synchronisation, peak memory, tables.

Benchmarks are scripts, never tests; each prints its baseline measured in the same run.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
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


def engine_step(engine, batches: list):
    """A training step over `batches` in turn ([micro, seq + 1] token ids: inputs and shifted targets on
    the engine's device): forward, `engine.backward`, `engine.step`; returns the loss, detached."""
    count = iter(range(10**9))

    def step():
        b = batches[next(count) % len(batches)].to(engine.device)
        out = engine(b[:, :-1], b[:, 1:])
        loss = out if torch.is_tensor(out) else out[0]
        engine.backward(loss)
        engine.step()
        return loss.detach()
    return step


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


def median_ms(step, warmup: int, steps: int, repeats: int) -> float:
    """`step()` (any return) run `warmup` times, then `repeats` windows of `steps`: the median window's
    ms per step (synchronized at each window's ends only)."""
    for _ in range(warmup):
        step()
    sync()
    windows = []
    for _ in range(max(repeats, 1)):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        windows.append((time.perf_counter() - t0) * 1e3 / max(steps, 1))
    return statistics.median(windows)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| in fp32 (Frobenius norms)."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def print_table(results: list[Result], baseline: str) -> None:
    base = next((r for r in results if r.name == baseline), None)
    print(f"{'run':<28}{'ms/step':>10}{'vs base':>9}{'tokens/s':>12}{'MFU':>7}{'peak GiB':>10}  note")
    for r in results:
        ratio = r.ms_per_step / base.ms_per_step if base and base.ms_per_step == base.ms_per_step else float("nan")
        print(f"{r.name:<28}{r.ms_per_step:>10.1f}{ratio:>9.2f}{r.tokens_per_s:>12.0f}{r.mfu:>7.3f}"
              f"{r.peak_gib:>10.2f}  {r.note}")


# ---------------------------------------------------------------- DeepSpeed in a child interpreter
RESULT_MARK = "@@RESULT@@ "  # a child's result line: the mark, then one JSON object


def emit_result(obj: dict) -> None:
    """In a child: print one result for `run_deepspeed_child` to collect."""
    print(RESULT_MARK + json.dumps(obj), flush=True)


def run_deepspeed_child(argv: list[str], python: str, site_dir: str | None = None, cpu: bool = False,
                        timeout: float = 3000.0) -> tuple[list[dict], str]:
    """Run `python *argv` as DeepSpeed's process (DeepSpeed is never imported in lightspeed's own):
    `site_dir`, where DeepSpeed is installed, goes first on its PYTHONPATH; on the CPU it gets
    DeepSpeed's CPU accelerator and one thread. Returns the objects it emitted (`emit_result`) and ''
    when it exited 0, else a one-line summary of its failure (exit status and the last lines)."""
    env = dict(os.environ)
    if site_dir:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site_dir, env.get("PYTHONPATH", "")) if p)
    if cpu:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([python, *argv], env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        stderr, rc = f"timed out after {timeout:.0f} s", "timeout"
    results = [json.loads(line[len(RESULT_MARK):]) for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
    if rc == 0:
        return results, ""
    tail = " | ".join((stderr or stdout).strip().splitlines()[-3:])
    return results, f"DeepSpeed child failed (exit {rc}): {tail}"[:400]
