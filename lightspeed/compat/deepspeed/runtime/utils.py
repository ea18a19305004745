"""`deepspeed.runtime.utils`: `see_memory_usage` (lightspeed/_utils/memory_usage.py), `set_random_seed`,
the pipeline's partition functions (`partition_uniform`, `partition_balanced`), and the gradient helpers
Megatron-style training loops call: `clip_grad_norm_`, `get_weight_norm`, `CheckOverflow`, `call_to_str`.

Note: [MoE norms] As DeepSpeed's, `clip_grad_norm_` averages the total norm over the data-parallel
group, so ranks whose expert (`allreduce=False`) gradients differ agree on one coefficient, and
`CheckOverflow` agrees an overflow over the largest expert-parallel group when a parameter is an
expert's. Tensor-parallel replicas count once: only model-parallel rank 0 adds a parameter that is not
split (`model_parallel` false or absent), as Megatron marks them.
"""

import math
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


__all__ = ["CheckOverflow", "call_to_str", "clip_grad_norm_", "get_weight_norm", "partition_balanced",
           "partition_uniform", "see_memory_usage", "set_random_seed"]
