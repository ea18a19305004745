"""Random number generator state for checkpoints: Python ``random``, torch CPU, every CUDA device,
and NumPy's global generator when NumPy is importable.

Owns capturing and restoring the generators. The state holds only tensors, lists, ints, floats, strs
and None, so it loads with ``torch.load(weights_only=True)``; no NumPy arrays or pickled objects.
It must not seed anything (seeding is the caller's policy).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

from lightspeed._utils.logging import get_logger, warn_once

__all__ = ["get_rng_state", "set_rng_state"]

logger = get_logger(__name__)


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def get_rng_state() -> dict[str, Any]:
    """Current generator states: ``{"python", "torch", "cuda" (one uint8 tensor per device, or
    absent), "numpy" (absent without NumPy)}``."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [t.cpu() for t in torch.cuda.get_rng_state_all()]
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {"kind": str(kind), "keys": [int(k) for k in keys], "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``get_rng_state`` captured. Parts this machine cannot restore (CUDA states
    without CUDA or for devices it lacks, NumPy state without NumPy) are skipped with a warning."""
    if "python" in state:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["internal"]), py["gauss_next"]))
    if "torch" in state:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    cuda_states = state.get("cuda")
    if cuda_states:
        num_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if num_devices < len(cuda_states):
            warn_once(f"rng state: the checkpoint holds CUDA generator states for {len(cuda_states)} devices "
                      f"but this process sees {num_devices}; restoring the first {num_devices}", logger)
        for device, cuda_state in enumerate(cuda_states[:num_devices]):
            torch.cuda.set_rng_state(torch.as_tensor(cuda_state, dtype=torch.uint8).cpu(), device)
    if "numpy" in state:
        np = _numpy()
        if np is None:
            warn_once("rng state: the checkpoint holds a NumPy generator state but NumPy is not installed; "
                      "skipping it", logger)
        else:
            st = state["numpy"]
            np.random.set_state((st["kind"], np.asarray(st["keys"], dtype=np.uint32), int(st["pos"]),
                                 int(st["has_gauss"]), float(st["cached_gaussian"])))
