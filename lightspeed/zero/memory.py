"""`MemoryTally`: a rank's bytes by device type and category, as `memory_breakdown()` reports them.

Categories: lp_params, master_params, grads, optimizer_state. Shared by every ZeRO stage. Keys are
device types ("cuda", "cpu" for host memory, pinned or not) and "nvme" for bytes that live only in
swap files (`locate` says where a tensor is when NVMe offload swaps it). "grads" counts the gradient
buffers a backward allocates, also between steps, when stages 1-3 have released them
(zero/grad_buffers.py): the figure is what a step holds, not what happens to be allocated at the call.
"""

from __future__ import annotations

import torch


class MemoryTally:
    def __init__(self, locate=None):
        self.bytes: dict[str, dict[str, int]] = {}
        self.locate = locate  # tensor -> "nvme" / "cpu" / None (not swapped: its device)

    def add(self, device: torch.device | str, key: str, nbytes: int) -> None:
        cats = self.bytes.setdefault(device if isinstance(device, str) else device.type, {})
        cats[key] = cats.get(key, 0) + nbytes

    def add_tensor(self, key: str, t: torch.Tensor) -> None:
        where = self.locate(t) if self.locate is not None else None
        self.add(where or t.device, key, t.numel() * t.element_size())

    def add_optimizer_state(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            return
        for state in optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    self.add_tensor("optimizer_state", v)
