"""The collectives buckets and parameter groups call, as objects handed to them at construction.

Owns: what goes on the wire for each kind of collective (the exact payload here; compressed ones in
`comm/onebit.py`, later quantized ones) and the count of the bytes each rank puts on the wire, per
collective. Must not: decide when a collective runs (buckets, parameter groups and optimizers do),
scale gradients, or issue a collective except through the `Communicator`.

Note (why objects): a strategy is built with one `Collectives` bundle and calls
`collectives.reduce_scatter(out, inp)` without knowing what is sent. Replacing the default objects by
compressed ones changes the wire format of every call site at once (FSDP2's `AllGather` /
`ReduceScatter` pattern), and the byte count stays with the code that knows the payload.

Note (bytes): each object records the bytes this rank contributes (its input), under its own name,
into a `CommStats` shared by the run (the `Communicator`'s), which the engine reports per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightspeed.comm.collectives import DONE, CommStats, Communicator


class AllReduce:
    """Exact all-reduce of a tensor in place (`op` sum, max or min)."""

    name = "all_reduce"

    def __init__(self, comm: Communicator, stats: CommStats | None = None):
        self.comm = comm
        self.stats = stats if stats is not None else comm.stats

    def __call__(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        if self.comm.world_size == 1:
            return DONE
        self.stats.add(self.name, tensor.numel() * tensor.element_size())
        return self.comm.all_reduce(tensor, op=op, async_op=async_op)


class ReduceScatter:
    """Exact reduce-scatter: `output` (one rank's part) receives the sum of every rank's `input`."""

    name = "reduce_scatter"

    def __init__(self, comm: Communicator, stats: CommStats | None = None):
        self.comm = comm
        self.stats = stats if stats is not None else comm.stats

    def __call__(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", async_op: bool = False):
        if self.comm.world_size == 1:
            output.copy_(input)
            return DONE
        self.stats.add(self.name, input.numel() * input.element_size())
        return self.comm.reduce_scatter(output, input, op=op, async_op=async_op)


class AllGather:
    """Exact all-gather of every rank's `input` into `output` (rank order)."""

    name = "all_gather"

    def __init__(self, comm: Communicator, stats: CommStats | None = None):
        self.comm = comm
        self.stats = stats if stats is not None else comm.stats

    def __call__(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        if self.comm.world_size == 1:
            output.copy_(input)
            return DONE
        # counted as the gathered size, as before the move (what every rank ends up receiving)
        self.stats.add(self.name, output.numel() * output.element_size())
        return self.comm.all_gather(output, input, async_op=async_op)


@dataclass(frozen=True)
class Collectives:
    """The collective objects one strategy uses. `default(comm)` gives the exact ones."""

    comm: Communicator
    all_reduce: AllReduce
    reduce_scatter: ReduceScatter
    all_gather: AllGather

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @classmethod
    def default(cls, comm: Communicator) -> "Collectives":
        return cls(comm, AllReduce(comm), ReduceScatter(comm), AllGather(comm))
