"""`MemoryTally`: a rank's bytes by device type and category, as `memory_breakdown()` reports them.

Categories: lp_params, master_params, grads, optimizer_state. Shared by every ZeRO stage.
"""

from __future__ import annotations

import torch


class MemoryTally:
    def __init__(self):
        self.bytes: dict[str, dict[str, int]] = {}

    def add(self, device: torch.device, key: str, nbytes: int) -> None:
        cats = self.bytes.setdefault(device.type, {})
        cats[key] = cats.get(key, 0) + nbytes

    def add_tensor(self, key: str, t: torch.Tensor) -> None:
        self.add(t.device, key, t.numel() * t.element_size())

    def add_optimizer_state(self, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            return
        for state in optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    self.add_tensor("optimizer_state", v)
