"""Overflow detection for gradients: is any element inf or NaN?

Owns the check only. It returns a 0-dim float32 tensor on the tensors' device (1.0 = overflow) and
never syncs with the host, so the caller can all-reduce the flag (MAX) across ranks first and read it
once. It must not import torch.distributed or decide what to do about an overflow.

Note: [why the infinity norm]
    DeepSpeed checks ``float(x.float().sum())`` per tensor: one host sync per tensor, and a sum that
    can overflow on finite data. An L2 norm has the same flaw (fp16 values of 60000 square to inf in
    fp16). The infinity norm, max |x|, never overflows on finite input and propagates both inf and
    NaN (CPU reductions and the CUDA foreach kernel both use NaN-propagating max), so
    ``isfinite(max |x|)`` is exactly "every element is finite". Empty tensors have no max and are
    skipped; they cannot hold an inf.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["has_inf_or_nan", "flat_has_inf_or_nan"]


def _as_flag(amax: torch.Tensor) -> torch.Tensor:
    return torch.logical_not(torch.isfinite(amax).all()).to(torch.float32)


def _check_floating(t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise TypeError(f"overflow check expects floating-point tensors (got {t.dtype})")


def flat_has_inf_or_nan(flat: torch.Tensor) -> torch.Tensor:
    """Overflow flag of one (flat) buffer of any shape and float dtype.

    Returns a 0-dim float32 tensor on ``flat.device``: 1.0 if any element is inf/NaN, else 0.0.
    """
    _check_floating(flat)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=flat.device)
    amax = torch.linalg.vector_norm(flat, ord=math.inf, dtype=torch.float32)
    return _as_flag(amax)


def has_inf_or_nan(tensors: Iterable[torch.Tensor | None], device: torch.device | str | None = None) -> torch.Tensor:
    """Overflow flag over many tensors (fp16 / bf16 / fp32, mixed allowed), computed in one fused pass.

    ``None`` entries (parameters without a gradient) and empty tensors are ignored. Returns a 0-dim
    float32 tensor, 1.0 if any element of any tensor is inf/NaN, on the tensors' device (``device``,
    or CPU, when there is nothing to check). Tensors spread over several devices are checked per
    device and the flag lands on the first tensor's device.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t is None:
            continue
        _check_floating(t)
        if device is None:
            device = t.device
        if t.numel() > 0:
            by_device.setdefault(t.device, []).append(t)
    out_device = torch.device(device) if device is not None else torch.device("cpu")
    if not by_device:
        return torch.zeros((), dtype=torch.float32, device=out_device)
    amaxes = []
    for group in by_device.values():
        # One kernel family per device; fp32 output so mixed input dtypes stack without promotion.
        norms = torch._foreach_norm(group, ord=math.inf, dtype=torch.float32)
        amaxes.append(torch.stack(norms).max().to(out_device))
    return _as_flag(torch.stack(amaxes))
