"""`deepspeed.runtime.utils`: `see_memory_usage` (lightspeed/_utils/memory_usage.py) and
`set_random_seed`."""

import random

import numpy
import torch

from lightspeed._utils.memory_usage import see_memory_usage


def set_random_seed(seed: int) -> None:
    """Seed the generators training draws from, as DeepSpeed's: Python's `random`, NumPy's global
    generator and torch's (which seeds every CUDA device too)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


__all__ = ["see_memory_usage", "set_random_seed"]
