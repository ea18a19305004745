"""`deepspeed.runtime.utils`: `see_memory_usage` (lightspeed/_utils/memory_usage.py), `set_random_seed`,
the pipeline's partition functions (`partition_uniform`, `partition_balanced`), and the gradient helpers
Megatron-style training loops call: `clip_grad_norm_`, `get_weight_norm`, `CheckOverflow`, `call_to_str`;
and DeepSpeed's small container and norm helpers (`move_to_device`, `copy_to_device`, `get_global_norm`,
`is_invalid_grad_norm`, `align_dense_tensors`, `prefix_sum_inc`, `get_only_unique_item`,
`ensure_directory_exists`, `empty_cache`, `noop_decorator`, `noop_context`).

Note: [MoE norms] As DeepSpeed's, `clip_grad_norm_` averages the total norm over the data-parallel
group, so ranks whose expert (`allreduce=False`) gradients differ agree on one coefficient, and
`CheckOverflow` agrees an overflow over the largest expert-parallel group when a parameter is an
expert's. Tensor-parallel replicas count once: only model-parallel rank 0 adds a parameter that is not
split (`model_parallel` false or absent), as Megatron marks them.
"""

import math
import os
import random

import numpy
import torch

from lightspeed._utils.memory_usage import see_memory_usage
from lightspeed.comm import api as dist
from lightspeed.compat.deepspeed.moe.utils import is_moe_param
from lightspeed.compat.deepspeed.utils import groups
from lightspeed.parallel.pipeline import partition_balanced, partition_uniform


def set_random_seed(seed: int) -> None:
    """Seed the generators training draws from, as DeepSpeed's: Python's `random`, NumPy's global
    generator and torch's (which seeds every CUDA device too)."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


def call_to_str(base: str, *args, **kwargs) -> str:
    """`base(arg, ..., key=value, ...)` with each argument's repr."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def _counts_once(p: torch.Tensor, mpu) -> bool:
    """Whether this rank adds `p` to a norm (Note: [MoE norms], tensor-parallel replicas)."""
    return mpu is None or mpu.get_model_parallel_rank() == 0 or bool(getattr(p, "model_parallel", False))


def _norm(tensors, norm_type: float, mpu, device) -> torch.Tensor:
    """The p-norm of `tensors` over this rank and the model-parallel group."""
    if norm_type == math.inf:
        total = torch.stack([t.detach().abs().max().float() for t in tensors]).max() if tensors else \
            torch.zeros((), device=device)
        total = total.to(device).reshape(1)
        if mpu is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
        return total
    norms = [t.detach().float().norm(norm_type) for t in tensors]
    total = (torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=device)).to(device).reshape(1)
    if mpu is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    return total.pow(1.0 / norm_type)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2, mpu=None) -> torch.Tensor:
    """Scale the gradients of `parameters` in place so their total `norm_type` norm is at most `max_norm`
    (coefficient `max_norm / (norm + 1e-6)`, at most 1); returns the total norm (a 1-element tensor),
    averaged over the data-parallel group (Note: [MoE norms]). A collective."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    device = parameters[0].grad.device if parameters else torch.device("cpu")
    norm_type = float(norm_type)
    total = _norm([p.grad for p in parameters if norm_type == math.inf or _counts_once(p, mpu)], norm_type, mpu,
                  device)
    group = groups._get_data_parallel_group()
    total = total / float(dist.get_world_size(group=group))
    dist.all_reduce(total, group=group)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in parameters:
        p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return total


def get_weight_norm(parameters, norm_type: float = 2, mpu=None) -> float:
    """The total `norm_type` norm of the tensors `parameters` (their values, not gradients) over the
    model-parallel group, as a float; -1 when it is inf or nan (DeepSpeed's overflow mark)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if not getattr(p, "ds_pipe_replicated", False)]
    device = parameters[0].device if parameters else torch.device("cpu")
    norm_type = float(norm_type)
    total = _norm([p for p in parameters if norm_type == math.inf or _counts_once(p, mpu)], norm_type, mpu,
                  device).item()
    return -1 if not math.isfinite(total) else total


class CheckOverflow:
    """Whether any gradient (or a norm from `get_weight_norm`) holds inf or nan, agreed over the ranks that
    must take the same decision (Note: [MoE norms]; the model-parallel group with an `mpu`)."""

    def __init__(self, param_groups=None, mpu=None, zero_reduce_scatter: bool = False, deepspeed=None):
        self.mpu, self.zero_reduce_scatter, self.deepspeed = mpu, zero_reduce_scatter, deepspeed
        self.params = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or ())

    def _agree(self, flag: bool, has_moe_params: bool, reduce: bool, device) -> bool:
        value = torch.tensor([float(flag)], device=device)
        if has_moe_params:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=groups._get_max_expert_parallel_group())
        if self.zero_reduce_scatter:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        elif self.mpu is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
        elif reduce:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def check_using_norm(self, norm_group, reduce_overflow: bool = True) -> bool:
        """True when a norm in `norm_group` is -1 (inf/nan)."""
        return self._agree(-1 in norm_group, self.has_moe_params, reduce_overflow, torch.device("cpu"))

    def check(self, param_groups=None) -> bool:
        if param_groups is None:
            return self.has_overflow(self.params, has_moe_params=self.has_moe_params)
        params = [p for group in param_groups for p in group]
        return self.has_overflow(params, has_moe_params=any(is_moe_param(p) for p in params))

    def has_overflow_serial(self, params) -> bool:
        return any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in params)

    def has_overflow(self, params, has_moe_params=None) -> bool:
        has_moe = self.has_moe_params if has_moe_params is None else has_moe_params
        device = next((p.grad.device for p in params if p.grad is not None), torch.device("cpu"))
        reduce = self.deepspeed is not None and getattr(self.deepspeed, "enable_backward_allreduce", True) is False
        return self._agree(self.has_overflow_serial(params), has_moe, reduce, device)


def move_to_device(item, device, criterion_func=None):
    """`item` (a tensor, or lists / tuples / dicts of them, nested) on `device`, the containers rebuilt.
    With `criterion_func`, an item it accepts is moved in place (its `.data` replaced) and returned
    itself; anything else that is not a container is moved with `.to(device)`, as DeepSpeed's."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


def copy_to_device(item, device, criterion_func):
    """A copy on `device` of each item `criterion_func` accepts, through lists / tuples / dicts; other
    items come back as they are."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, list):
        return [copy_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(copy_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: copy_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def is_invalid_grad_norm(norm) -> bool:
    """A norm that is inf, nan or negative (a tensor: any element)."""
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


def get_global_norm(norm_list) -> float:
    """The 2-norm of norms (sqrt of the sum of their squares); inf when one is invalid."""
    if any(is_invalid_grad_norm(norm) for norm in norm_list):
        return float("inf")
    return math.sqrt(sum(float(norm) ** 2.0 for norm in norm_list))


def align_dense_tensors(tensor_list: list, alignment: int) -> list:
    """`tensor_list`, plus a zero tensor (the first's dtype and device) that pads the total element
    count to a multiple of `alignment`, where it is not one already."""
    remaining = sum(t.numel() for t in tensor_list) % alignment
    if not remaining:
        return tensor_list
    pad = torch.zeros(alignment - remaining, device=tensor_list[0].device, dtype=tensor_list[0].dtype)
    return tensor_list + [pad]


def prefix_sum_inc(weights) -> list:
    """The inclusive prefix sums: [3, 4, 5] -> [3, 7, 12]."""
    out = list(weights)
    for i in range(1, len(out)):
        out[i] += out[i - 1]
    return out


def get_only_unique_item(items):
    """The one distinct value of `items`; RuntimeError when there are none or several."""
    distinct = set(items)
    if len(distinct) != 1:
        raise RuntimeError(f"expected there to be only one unique element in {items}")
    return next(iter(distinct))


def ensure_directory_exists(filename: str) -> None:
    """Creates the directory that `filename` is in (and its parents)."""
    os.makedirs(os.path.dirname(filename), exist_ok=True)


def empty_cache() -> None:
    """Releases the accelerator's cached memory and resets its peak-memory statistics."""
    from lightspeed._utils.accelerator import get_accelerator

    get_accelerator().empty_cache()
    get_accelerator().reset_peak_memory_stats()


def noop_decorator(func):
    return func


class noop_context:
    """A context manager that does nothing."""

    def __enter__(self):
        return None

    def __exit__(self, exc_type, exc_val, exc_tb):
        return None


__all__ = ["CheckOverflow", "align_dense_tensors", "call_to_str", "clip_grad_norm_", "copy_to_device", "empty_cache",
           "ensure_directory_exists", "get_global_norm", "get_only_unique_item", "get_weight_norm",
           "is_invalid_grad_norm", "move_to_device", "noop_context", "noop_decorator", "partition_balanced",
           "partition_uniform", "prefix_sum_inc", "see_memory_usage", "set_random_seed"]
