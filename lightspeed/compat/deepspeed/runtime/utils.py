"""`deepspeed.runtime.utils`: `see_memory_usage` (lightspeed/_utils/memory_usage.py), `set_random_seed`
and the pipeline's partition functions (`partition_uniform`, `partition_balanced`)."""

import random

import numpy
import torch

from lightspeed._utils.memory_usage import see_memory_usage
from lightspeed.parallel.pipeline import partition_balanced, partition_uniform


def set_random_seed(seed: int) -> None:
    """Seed the generators training draws from, as DeepSpeed's: Python's `random`, NumPy's global
    generator and torch's (which seeds every CUDA device too)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


__all__ = ["partition_balanced", "partition_uniform", "see_memory_usage", "set_random_seed"]
