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
All-gathers count the gathered size (what every rank ends up receiving), as before the objects existed.

Note (parameter gathers): a stage-3 parameter group gathers through its own `ParamGather`, made by
`Collectives.param_gather`: it owns what must persist between one group's gathers (ZeRO++'s hpZ
secondary shard). An all-gather object exposes its wire format as a *payload*: `encode(shard)` gives
a tuple of 2-D tensors with one row per rank's shard, `gather_payload` gathers the rows of every rank
of its communicator and, on `wait()`, decodes them into the output. The exact payload is the shard
itself, gathered straight into the output; ZeRO++'s quantized one (`comm/quantized.py`) int8 codes
and block scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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
    """Exact all-gather of every rank's `input` into `output` (rank order). `inter_node_fraction`, when
    the node layout is known, is the share of the gathered bytes that comes from other nodes."""

    name = "all_gather"

    def __init__(self, comm: Communicator, stats: CommStats | None = None, *, name: str | None = None,
                 inter_node_fraction: float | None = None):
        self.comm = comm
        self.stats = stats if stats is not None else comm.stats
        self.name = name or type(self).name
        self.inter_node_fraction = inter_node_fraction

    def _count(self, nbytes: int) -> None:
        inter = None if self.inter_node_fraction is None else round(nbytes * self.inter_node_fraction)
        self.stats.add(self.name, nbytes, inter)

    def __call__(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        if self.comm.world_size == 1:
            output.copy_(input)
            return DONE
        self._count(output.numel() * output.element_size())
        return self.comm.all_gather(output, input, async_op=async_op)

    def encode(self, shard: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (shard.reshape(1, -1),)

    def gather_payload(self, output: torch.Tensor, payload: tuple[torch.Tensor, ...], async_op: bool = False):
        """Gather every rank's payload rows into `output` (flat, rows x row length); returns the handle and
        the gathered payload (here views of `output`)."""
        (rows,) = payload
        gathered = output.view(-1, rows.shape[1])
        return self(output, rows.reshape(-1), async_op=async_op), (gathered,)


class _Then:
    """A handle that runs `after()` once, when the collective it wraps has completed."""

    def __init__(self, handle, after):
        self.handle, self.after = handle, after

    def wait(self) -> bool:
        self.handle.wait()
        if self.after is not None:
            after, self.after = self.after, None
            after()
        return True

    def is_completed(self) -> bool:
        return self.after is None


class ParamGather:
    """The all-gathers of one stage-3 parameter group: `gather(output, shard)` fills `output` (the
    group's padded flat buffer) from every rank's shard.

    With `partition_gather` (ZeRO++'s hpZ, `zero_hpz_partition_size` = P ranks per partition, over this
    rank's partition group of P consecutive ranks, in which it has index `partition_rank`): the first
    gather after the shard changed runs over the whole data-parallel group and keeps this rank's
    secondary shard (the payload rows of the P-th of the buffer this rank holds within its partition
    group); the gathers that follow (backward, and the next micro-steps' forwards) read the secondary
    shards within the partition group only. `shard_changed()` (after an optimizer step or a load) drops
    it, so the next gather refreshes it."""

    def __init__(self, all_gather, partition_gather=None, partition_size: int = 1, partition_rank: int = 0):
        self.all_gather, self.partition_gather = all_gather, partition_gather
        self.partition_size, self.partition_rank = partition_size, partition_rank
        self._secondary: tuple[torch.Tensor, ...] | None = None

    def __call__(self, output: torch.Tensor, shard, async_op: bool = False):
        if self.partition_gather is None:
            return self.all_gather(output, shard, async_op=async_op)
        if self._secondary is not None:
            handle, _ = self.partition_gather.gather_payload(output, self._secondary, async_op=async_op)
            return handle
        handle, gathered = self.all_gather.gather_payload(output, self.all_gather.encode(shard), async_op=async_op)
        return _Then(handle, lambda: self._keep(gathered))

    def _keep(self, gathered: tuple[torch.Tensor, ...]) -> None:
        rows = gathered[0].shape[0] // self.partition_size
        start = self.partition_rank * rows
        # copies: the exact payload is a view of the output, whose storage is freed at release
        self._secondary = tuple(t[start:start + rows].clone() for t in gathered)

    def shard_changed(self) -> None:
        self._secondary = None

    @property
    def secondary_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._secondary) if self._secondary is not None else 0


@dataclass(frozen=True)
class Collectives:
    """The collective objects one strategy uses. `default(comm)` gives the exact ones; ZeRO++'s come
    from `comm/zeropp.py`. `param_gathers(trainable)` makes one stage-3 parameter group's `ParamGather`
    and `store_shard(shard, trainable)` says in what form a group keeps its shard (ZeRO++ keeps frozen
    weights quantized); by default, `ParamGather(all_gather)` and the shard itself."""

    comm: Communicator
    all_reduce: AllReduce
    reduce_scatter: ReduceScatter
    all_gather: AllGather
    param_gathers: Callable[[bool], ParamGather] | None = None
    shard_store: Callable[[torch.Tensor, bool], Any] | None = None

    def param_gather(self, trainable: bool) -> ParamGather:
        return self.param_gathers(trainable) if self.param_gathers is not None else ParamGather(self.all_gather)

    def store_shard(self, shard: torch.Tensor, trainable: bool):
        return self.shard_store(shard, trainable) if self.shard_store is not None else shard

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @classmethod
    def default(cls, comm: Communicator) -> "Collectives":
        return cls(comm, AllReduce(comm), ReduceScatter(comm), AllGather(comm))
