"""The torch.distributed.pipelining pieces the pipeline schedule driver (parallel/pipeline/schedule.py)
stands on: a `PipelineStage` whose gradient-writing backwards are bracketed for the ZeRO strategy,
torch's schedule classes by name, and the point-to-point sends of the driver's shape probe.

Owns: those, and nothing of the schedule's policy. Must not: know ZeRO or the pipeline module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules


def schedule_class(name: str):
    """torch.distributed.pipelining's schedule class `name` (e.g. "Schedule1F1B")."""
    return getattr(torch_schedules, name)


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8


def as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def example_of(t: torch.Tensor) -> torch.Tensor:
    """A detached example of `t` carrying whether the schedule sends a gradient back for it."""
    out = t.detach()
    return out.requires_grad_(out.is_floating_point())


def send_tensors(tensors: tuple, dst: int) -> None:
    dist.send(torch.tensor([len(tensors)], dtype=torch.int64, device=tensors[0].device), dst)
    for t in tensors:
        if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
            raise TypeError(f"a pipeline stage output of dtype {t.dtype} and {t.dim()} dims cannot be sent")
        header = [_DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_MAX_DIMS - t.dim())
        dist.send(torch.tensor(header, dtype=torch.int64, device=t.device), dst)
        dist.send(t.detach().contiguous(), dst)


def recv_tensors(src: int, device: torch.device) -> tuple:
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, src)
    out = []
    for _ in range(int(count)):
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
        dist.recv(header, src)
        h = header.tolist()
        buf = torch.empty(h[2:2 + h[1]], dtype=_DTYPES[h[0]], device=device)
        dist.recv(buf, src)
        out.append(buf)
    return tuple(out)


def _run_accumulate_hooks(module: torch.nn.Module) -> None:
    """Run each parameter's post-accumulate-grad hooks where it holds a gradient (the Note on brackets)."""
    for p in module.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if p.grad is not None and hooks:
            for hook in list(hooks.values()):
                hook(p)


class BracketedStage(PipelineStage):
    """A `PipelineStage` whose gradient-writing backwards are bracketed: `driver.backward_begin()` before
    and `driver.backward_done()` after each (parallel/pipeline/schedule.py's Note on brackets)."""

    def __init__(self, chunk, stage_index, num_stages, device, group, driver, example_in,
                 example_out):
        super().__init__(chunk, stage_index, num_stages, device, input_args=example_in, output_args=example_out,
                         group=group)
        self._driver = driver

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if not full_backward or not self.has_backward:
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)
        self._driver.backward_begin()
        try:
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=True, last_backward=last_backward)
        finally:
            self._driver.backward_done()

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        if not self.has_backward:
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._driver.backward_begin()
        try:
            out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if self.stage_index != 0 and self.dw_builder is None:  # param.grad assigned, not accumulated
                _run_accumulate_hooks(self.submod)
            return out
        finally:
            self._driver.backward_done()
