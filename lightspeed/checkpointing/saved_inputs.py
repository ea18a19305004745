"""What a checkpoint keeps of its inputs between the forward and the recomputation, and how it gets
them back: whole, moved to host memory (`cpu_checkpointing`), or partitioned over the model-parallel
group (`partition_activations`, each rank keeping 1/size of every input and all-gathering them before
recomputing), optionally in preallocated contiguous buffers (`contiguous_memory_optimization`).

Owns: `ModelParallel` (the group read from an `mpu`), `SavedInputs` (pack / unpack) and
`ContiguousPartitions`. Must not: run the function or touch random state (`function.py` does);
collectives go through `lightspeed.comm`.

Which inputs are activations follows DeepSpeed: floating-point tensors with at least as many elements
as the model-parallel size; other tensors (token ids, masks) and non-tensors are kept as they are.
Partitioning assumes, as Megatron's tensor-parallel regions guarantee, that an activation is the same
on every rank of the model-parallel group: rank r keeps elements [r*n/size, (r+1)*n/size) of it.
*Changed* from DeepSpeed: an input is brought back to the device it came from (DeepSpeed moves every
activation to the current accelerator device), and the caller's tensors are never modified (DeepSpeed
points the caller's `arg.data` at the partition).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lightspeed.comm.collectives import Communicator


@dataclass(frozen=True)
class ModelParallel:
    """This rank's place in the model-parallel group that activations are partitioned over."""

    rank: int
    size: int
    group: Any

    @classmethod
    def none(cls) -> "ModelParallel":
        return cls(0, 1, None)

    @classmethod
    def from_mpu(cls, mpu: Any) -> "ModelParallel":
        """From a Megatron-style `mpu`: its tensor-model-parallel group where it has one (DeepSpeed's
        order), else its model-parallel group; no mpu is a group of one."""
        if mpu is None:
            return cls.none()
        for prefix in ("get_tensor_model_parallel", "get_model_parallel"):
            if hasattr(mpu, prefix + "_rank"):
                try:
                    return cls(int(getattr(mpu, prefix + "_rank")()), int(getattr(mpu, prefix + "_world_size")()),
                               getattr(mpu, prefix + "_group")())
                except AttributeError as err:
                    raise TypeError(f"checkpointing.configure: the mpu has {prefix}_rank but not the matching "
                                    f"_world_size / _group ({err})") from None
        raise TypeError("checkpointing.configure: the mpu has neither get_tensor_model_parallel_rank/_world_size/"
                        "_group nor get_model_parallel_rank/_world_size/_group")


def is_activation(item: Any, mp_size: int) -> bool:
    """DeepSpeed's `is_activation_to_checkpoint`."""
    return torch.is_tensor(item) and item.is_floating_point() and item.numel() >= mp_size


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (pinned, copied without a host sync, when `t` is on CUDA); `t` itself when it
    already lives on the host."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class _Buffer:
    flat: torch.Tensor
    numel_each: int
    used: int = 0


@dataclass
class ContiguousPartitions:
    """Per input position, one preallocated buffer of `number_checkpoints` partitions that the
    checkpoints of a forward fill in order, so the kept activations are not scattered over the
    allocator. Cleared by the first recomputation of a backward (the partitions stay alive through the
    checkpoints that hold views of them) and by `reset()`."""

    buffers: dict[int, _Buffer] = field(default_factory=dict)

    def clear(self) -> None:
        self.buffers = {}

    def take(self, position: int, shard: torch.Tensor, number_checkpoints: int, device: torch.device) -> torch.Tensor:
        """A view of the next free slot at `position` (on `device`) holding a copy of `shard`."""
        entry = self.buffers.get(position)
        if entry is None:
            flat = torch.empty(number_checkpoints * shard.numel(), dtype=shard.dtype, device=device,
                               pin_memory=device.type == "cpu" and shard.device.type == "cuda")
            entry = self.buffers[position] = _Buffer(flat, shard.numel())
        if entry.numel_each != shard.numel() or entry.flat.dtype != shard.dtype:
            raise ValueError(f"activation_checkpointing.contiguous_memory_optimization: checkpointed input "
                             f"{position} has {shard.numel()} {shard.dtype} elements per partition here but "
                             f"{entry.numel_each} {entry.flat.dtype} in the first checkpoint; the buffers need "
                             "every checkpoint's inputs to have the same sizes")
        if entry.used == number_checkpoints:
            raise ValueError(f"activation_checkpointing.number_checkpoints is {number_checkpoints} but this forward "
                             "makes more checkpoint() calls before a backward; raise it (or call "
                             "checkpointing.reset() after forwards without a backward)")
        slot = entry.flat.narrow(0, entry.used * entry.numel_each, entry.numel_each)
        slot.copy_(shard, non_blocking=True)
        entry.used += 1
        return slot


@dataclass(frozen=True)
class _Kept:
    """How one argument was kept: `index` into the kept tensors (None: `value` is the argument)."""

    index: int | None
    value: Any = None
    how: str = "whole"  # "whole" | "host" | "partition"
    shape: torch.Size | None = None
    device: torch.device | None = None
    requires_grad: bool = False


class SavedInputs:
    """The arguments of one checkpoint as kept for its recomputation. `tensors` are what must be kept
    alive (the reentrant checkpoint hands them to `ctx.save_for_backward`); `unpack(tensors)` returns
    the arguments, detached, on their devices, with their `requires_grad`."""

    def __init__(self, args: tuple, *, partition: bool, to_host: bool, mp: ModelParallel,
                 contiguous: ContiguousPartitions | None = None, number_checkpoints: int | None = None):
        self.mp = mp
        self.tensors: list[torch.Tensor] = []
        self.kept: list[_Kept] = []
        position = 0
        for arg in args:
            if not torch.is_tensor(arg):
                self.kept.append(_Kept(None, arg))
                continue
            how, kept = "whole", arg
            if is_activation(arg, mp.size):
                if partition:
                    how, kept = "partition", self._partition(arg, position, to_host, contiguous, number_checkpoints)
                elif to_host:
                    how, kept = "host", _to_host(arg.detach())
                position += 1
            self.kept.append(_Kept(len(self.tensors), None, how, arg.shape, arg.device, arg.requires_grad))
            self.tensors.append(kept)

    def _partition(self, arg: torch.Tensor, position: int, to_host: bool, contiguous: ContiguousPartitions | None,
                   number_checkpoints: int | None) -> torch.Tensor:
        size, rank = self.mp.size, self.mp.rank
        if arg.numel() % size:
            raise ValueError(f"activation_checkpointing.partition_activations: a checkpointed input of shape "
                             f"{tuple(arg.shape)} ({arg.numel()} elements) does not split evenly over the "
                             f"model-parallel group of {size}")
        numel = arg.numel() // size
        shard = arg.detach().reshape(-1).narrow(0, rank * numel, numel)
        if contiguous is not None:
            assert number_checkpoints is not None
            return contiguous.take(position, shard, number_checkpoints,
                                   torch.device("cpu") if to_host else shard.device)
        if to_host:
            return _to_host(shard.clone() if shard.device.type == "cpu" and size > 1 else shard)
        # a shard of its own, so the whole input can be freed; with a group of one it is the input itself
        return shard.clone() if size > 1 else shard

    def unpack(self, tensors) -> list[Any]:
        """The arguments again: host copies moved back, partitions all-gathered over the group."""
        out = []
        comm = Communicator(self.mp.group, self.mp.size) if self.mp.size > 1 else None
        for k in self.kept:
            if k.index is None:
                out.append(k.value)
                continue
            t = tensors[k.index]
            if k.how != "whole":
                t = t.to(k.device, non_blocking=True)
            if k.how == "partition":
                if comm is not None:
                    full = torch.empty(t.numel() * self.mp.size, dtype=t.dtype, device=t.device)
                    comm.all_gather(full, t)
                    t = full
                t = t.view(k.shape)
            t = t.detach()
            t.requires_grad_(k.requires_grad)
            out.append(t)
        return out
