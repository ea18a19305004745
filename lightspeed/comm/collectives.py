"""Collectives over one process group, with byte counting. The only place collectives are issued.

Every call returns a handle with `wait()`; at world size 1 nothing is sent and the handle is a no-op.
Bytes are counted as the payload each rank contributes (the tensor's size in bytes), per op, so the
engine can report communication volume per step.

Note: torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of
all_gather_single / reduce_scatter_single (same signatures), while torch 2.11 lacks the new names;
the choice is made once here by feature detection.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

# all_gather_single(output, input, group=, async_op=) / reduce_scatter_single(output, input, op=, group=,
# async_op=): torch's newest names for the flat-tensor collectives, or the older ones they replace.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = all_gather_single
_REDUCE_SCATTER = reduce_scatter_single

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class _Done:
    """Handle of a collective that needed no communication."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


class CommStats:
    """Bytes and call counts per collective since the last `reset()`."""

    def __init__(self):
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def add(self, op: str, tensor: torch.Tensor) -> None:
        self.bytes[op] += tensor.numel() * tensor.element_size()
        self.calls[op] += 1

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


class Communicator:
    """Collectives on one group (None = the default group). `world_size` 1 short-circuits them all."""

    def __init__(self, group: Any = None, world_size: int | None = None, stats: CommStats | None = None):
        self.group = group
        if world_size is None:
            world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.world_size = world_size
        self.rank = dist.get_rank(group) if dist.is_initialized() and world_size > 1 else 0
        self.stats = stats if stats is not None else CommStats()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        if self.world_size == 1:
            return DONE
        self.stats.add("all_reduce", tensor)
        work = dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=async_op)
        return work if async_op else DONE

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", async_op: bool = False):
        if self.world_size == 1:
            output.copy_(input)
            return DONE
        self.stats.add("reduce_scatter", input)
        work = _REDUCE_SCATTER(output, input, op=_OPS[op], group=self.group, async_op=async_op)
        return work if async_op else DONE

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        if self.world_size == 1:
            output.copy_(input)
            return DONE
        self.stats.add("all_gather", output)
        work = _ALL_GATHER(output, input, group=self.group, async_op=async_op)
        return work if async_op else DONE

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Broadcast from the rank whose rank *within this group* is `src`."""
        if self.world_size == 1:
            return DONE
        self.stats.add("broadcast", tensor)
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        work = dist.broadcast(tensor, src=global_src, group=self.group, async_op=async_op)
        return work if async_op else DONE

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank (control data only, never tensors of state)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
