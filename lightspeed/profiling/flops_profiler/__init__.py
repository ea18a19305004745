"""DeepSpeed's `deepspeed.profiling.flops_profiler`: `get_model_profile`, `FlopsProfiler` and the
number formats."""

from lightspeed.profiling.flops_profiler.profiler import FlopsProfiler, get_model_profile
from lightspeed.profiling.flops_profiler.report import (
    duration_to_string, flops_to_string, macs_to_string, number_to_string, params_to_string,
)  # fmt: skip

__all__ = [
    "FlopsProfiler", "get_model_profile", "number_to_string", "macs_to_string", "flops_to_string",
    "params_to_string", "duration_to_string",
]
