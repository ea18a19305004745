"""Collectives over one process group. The only place collectives are issued.

Every call returns a handle with `wait()`; at world size 1 nothing is sent and the handle is a no-op.
Bytes on the wire are counted by the collective objects of `comm/codecs.py` (which know the payload),
into the `CommStats` this communicator carries for the run. When the comms logger is on
(`comm/comms_logger.py`), every profiled op is timed here, synchronously.
Every blocking wait (a synchronous call, or `wait()` on a returned handle) runs under the process's
collective watchdog when `init_distributed` installed one, so a rank stuck in a collective says which
one (comm/watchdog.py).

Note: torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of
all_gather_single / reduce_scatter_single (same signatures), while torch 2.11 lacks the new names;
the choice is made once here by feature detection.
"""

from __future__ import annotations

import contextlib

import time
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightspeed.comm import watchdog
from lightspeed.comm.comms_logger import COMMS_LOGGER

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


class _Watched:
    """Handle of an asynchronous collective whose `wait()` runs under the collective watchdog."""

    def __init__(self, work, desc: tuple, dog: "watchdog.CollectiveWatchdog"):
        self._work, self._desc, self._dog = work, desc, dog

    def wait(self) -> bool:
        with self._dog.watch(self._desc):
            return self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()


class CommStats:
    """Bytes and call counts per collective since the last `reset()`. `inter_node_bytes` holds, for the
    collectives that know the node layout (ZeRO++'s hierarchical ones), the part of their bytes that
    crosses nodes (already included in `bytes`)."""

    def __init__(self):
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.inter_node_bytes: dict[str, int] = defaultdict(int)

    def add(self, op: str, nbytes: int, inter_node: int | None = None) -> None:
        self.bytes[op] += int(nbytes)
        self.calls[op] += 1
        if inter_node is not None:
            self.inter_node_bytes[op] += int(inter_node)

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.inter_node_bytes.clear()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Communicator:
    """Collectives on one group (None = the default group). `world_size` 1 short-circuits them all.
    `stats` is the run's byte tally, written by the collective objects built on this communicator."""

    def __init__(self, group: Any = None, world_size: int | None = None, stats: CommStats | None = None):
        self.group = group
        if world_size is None:
            world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.world_size = world_size
        self.rank = dist.get_rank(group) if dist.is_initialized() and world_size > 1 else 0
        self.stats = stats if stats is not None else CommStats()

    @property
    def backend(self) -> str | None:
        """The group's backend name ("gloo", "nccl", ...), or None without a process group."""
        if not dist.is_initialized():
            return None
        return str(dist.get_backend(self.group)).lower()

    def _issue(self, name: str, tensor: torch.Tensor, nbytes: int, call: Callable[[bool], Any], async_op: bool,
               desc: str | None = None):
        """Run `call(async_op)`, its blocking wait under the watchdog when one is installed (comm/watchdog.py);
        when the comms logger profiles `name`, run it to completion and time it."""
        dog = watchdog.current()
        what = (desc or name, tensor.numel() * tensor.element_size(), self.world_size)
        if COMMS_LOGGER.profiles(name):
            sync = torch.cuda.synchronize if tensor.is_cuda else (lambda: None)
            sync()
            start = time.perf_counter()
            with dog.watch(what) if dog is not None else contextlib.nullcontext():
                work = call(True)
                if work is not None:
                    work.wait()
            sync()
            COMMS_LOGGER.record(name, (time.perf_counter() - start) * 1e3, nbytes, self.world_size)
            return DONE
        if dog is None:
            work = call(async_op)
            return work if async_op else DONE
        if async_op:
            return _Watched(call(True), what, dog)
        with dog.watch(what):
            call(False)
        return DONE

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        if self.world_size == 1:
            return DONE
        return self._issue("all_reduce", tensor, _nbytes(tensor),
                           lambda a: dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=a), async_op,
                           desc=f"all_reduce ({op})")

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", async_op: bool = False):
        if self.world_size == 1:
            output.copy_(input)
            return DONE
        # message size: this rank's part, as DeepSpeed's logger reads it (its bandwidth multiplies by n)
        return self._issue("reduce_scatter", input, _nbytes(output),
                           lambda a: _REDUCE_SCATTER(output, input, op=_OPS[op], group=self.group, async_op=a),
                           async_op, desc=f"reduce_scatter ({op})")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        if self.world_size == 1:
            output.copy_(input)
            return DONE
        return self._issue("all_gather", input, _nbytes(input),
                           lambda a: _ALL_GATHER(output, input, group=self.group, async_op=a), async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Equal splits along dim 0: rank r's part i of `input` lands in part r of rank i's `output`."""
        if self.world_size == 1:
            output.copy_(input)
            return DONE
        return self._issue("all_to_all_single", input, _nbytes(input),
                           lambda a: dist.all_to_all_single(output, input, group=self.group, async_op=a), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Broadcast from the rank whose rank *within this group* is `src`."""
        if self.world_size == 1:
            return DONE
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._issue("broadcast", tensor, _nbytes(tensor),
                           lambda a: dist.broadcast(tensor, src=global_src, group=self.group, async_op=a), async_op,
                           desc=f"broadcast (from rank {global_src})")

    def barrier(self) -> None:
        if self.world_size > 1:
            self._run("barrier", None, False, lambda: dist.barrier(group=self.group))

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank (control data only, never tensors of state)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._run("all_gather_object", None, False, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def _run(self, name: str, tensor: torch.Tensor | None, async_op: bool, issue):
        """Issue a collective; its blocking wait runs under the watchdog (when one is installed)."""
        dog = watchdog.current()
        if dog is None:
            work = issue()
            return work if async_op else DONE
        desc = (name, tensor.numel() * tensor.element_size() if tensor is not None else None, self.world_size)
        if async_op:
            return _Watched(issue(), desc, dog)
        with dog.watch(desc):
            issue()
        return DONE
