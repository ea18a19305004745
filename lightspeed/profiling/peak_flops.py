"""Peak dense matmul throughput of known accelerators, for model-FLOPs utilization (MFU).

A small table by device name and dtype (vendor datasheet figures, dense, without sparsity; fp32 is
the plain FP32 rate, not TF32). A device or dtype not in the table has no peak, and its MFU is
reported as unknown rather than guessed. Must not: measure anything.
"""

from __future__ import annotations

import re

import torch

_BF16, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32

# (pattern on torch.cuda.get_device_name(), {dtype: dense TFLOPS}); the first match wins, so the
# specific variants come before the family name
PEAK_TFLOPS: tuple[tuple[str, dict[torch.dtype, float]], ...] = (
    (r"H100.*(PCIe|PCIE)", {_BF16: 756.0, _FP16: 756.0, _FP32: 51.2}),
    (r"H100.*NVL", {_BF16: 835.0, _FP16: 835.0, _FP32: 60.0}),
    (r"H100|H200|GH200", {_BF16: 989.0, _FP16: 989.0, _FP32: 67.0}),
    (r"A100", {_BF16: 312.0, _FP16: 312.0, _FP32: 19.5}),
    (r"V100", {_FP16: 125.0, _FP32: 15.7}),
    (r"L40S", {_BF16: 362.0, _FP16: 362.0, _FP32: 91.6}),
    (r"\bL4\b", {_BF16: 121.0, _FP16: 121.0, _FP32: 30.3}),
)


def device_name(device: torch.device) -> str:
    """The accelerator's name (`torch.cuda.get_device_name`), or the device type for others."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def peak_tflops(name: str, dtype: torch.dtype) -> float | None:
    """Dense peak TFLOPS of the device called `name` at `dtype`, or None when not known."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            return peaks.get(dtype)
    return None


def mfu(achieved_flops_per_s: float, name: str, dtype: torch.dtype) -> float | None:
    """Achieved FLOP/s as a fraction of the peak, or None when the peak is not known."""
    peak = peak_tflops(name, dtype)
    return None if peak is None else achieved_flops_per_s / (peak * 1e12)
