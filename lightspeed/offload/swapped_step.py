"""The optimizer step of ZeRO-Infinity's NVMe optimizer offload: one sub-group at a time, the next
sub-group's fp32 master and optimizer state read from NVMe while this one steps.

Owns: which host tensors make up a sub-group (the master's base tensor and the optimizer's state
tensors of the pieces it steps), bringing sub-groups in and sending them out through an
`NvmeSwapper`, and the per-sub-group optimizer step. Must not: compute norms or coefficients (the
shared step did), or write parameters (the strategy's `after` callback does, before the sub-group is
sent out).

Note (state tensors): optimizers create their state at the first step and `load_state_dict`
replaces it, so the state tensors of a sub-group are looked up again every time it is sent out and
tracked by slot name (sub-group, piece, key); a slot whose tensor changed has the old one forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from lightspeed.offload.nvme import NvmeSwapper


@dataclass
class SubGroup:
    name: str
    bases: list[torch.Tensor]  # host tensors owning storage (the master shard)
    owners: list[torch.Tensor]  # the optimizer's tensors (views of `bases`) stepped together


class SwappedOptimizerState:
    def __init__(self, swapper: NvmeSwapper, optimizer: torch.optim.Optimizer | None, subgroups: list[SubGroup],
                 buffer_count: int = 4):
        self.swapper, self.optimizer, self.subgroups = swapper, optimizer, subgroups
        # DeepSpeed's `offload_optimizer.buffer_count` buffers hold one sub-group's master, gradient and
        # two Adam moments per 4: that many sub-groups are read ahead of the one stepping
        self.read_ahead = max(1, int(buffer_count) // 4)
        self._slots: dict[str, torch.Tensor] = {}
        for sg in subgroups:
            for i, b in enumerate(sg.bases):
                self._track(f"{sg.name}.master{i}", b)

    def _track(self, slot: str, tensor: torch.Tensor) -> None:
        old = self._slots.get(slot)
        if old is tensor:
            return
        if old is not None:
            self.swapper.forget(old)
        self.swapper.register(tensor, slot)
        self._slots[slot] = tensor

    def _states(self, sg: SubGroup) -> list[tuple[str, torch.Tensor]]:
        out = []
        if self.optimizer is None:
            return out
        for i, owner in enumerate(sg.owners):
            for key, value in self.optimizer.state.get(owner, {}).items():
                if torch.is_tensor(value) and value.numel() == owner.numel() and value.numel() > 1:
                    out.append((f"{sg.name}.{i}.{key}", value))
        return out

    def _tensors(self, sg: SubGroup) -> list[torch.Tensor]:
        return list(sg.bases) + [t for _, t in self._states(sg)]

    def bring_in(self, index: int) -> None:
        for t in self._tensors(self.subgroups[index]):
            self.swapper.ensure_in(t)

    def prefetch(self, index: int) -> None:
        if index >= len(self.subgroups):
            return
        for t in self._tensors(self.subgroups[index]):
            if self.swapper.registered(t):
                self.swapper.prefetch(t)

    def send_out(self, index: int) -> None:
        sg = self.subgroups[index]
        for slot, t in self._states(sg):
            if not t.is_contiguous() or t.is_pinned():
                continue
            self._track(slot, t)
        for t in self._tensors(sg):
            if self.swapper.registered(t):
                self.swapper.swap_out(t)

    def all_in(self) -> None:
        for i in range(len(self.subgroups)):
            self.bring_in(i)

    def all_out(self) -> None:
        for i in range(len(self.subgroups)):
            self.send_out(i)

    def step(self, opt_grads: dict[torch.Tensor, torch.Tensor], optimizer: torch.optim.Optimizer,
             after: Callable[[int], None]) -> None:
        """Step each sub-group in turn (reading the next one meanwhile), call `after(i)` while its
        master is in memory, then send it out."""
        for i, sg in enumerate(self.subgroups):
            self.bring_in(i)
            for ahead in range(i + 1, min(i + 1 + self.read_ahead, len(self.subgroups))):
                self.prefetch(ahead)
            stepped = [t for t in sg.owners if t in opt_grads]
            for t in stepped:
                t.grad = opt_grads[t]
            if stepped:
                optimizer.step()
            for t in stepped:
                t.grad = None
            after(i)
            self.send_out(i)
