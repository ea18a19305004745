"""Tiny deterministic models and data for parity tests (awkward sizes on purpose)."""

from __future__ import annotations

import torch


class TinyMLP(torch.nn.Module):
    """Linear(13->37) -> GELU -> LayerNorm -> Linear(37->5) with a 3-element parameter (smaller than
    a world size of 4) and one frozen parameter. Returns the MSE loss when targets are given."""

    def __init__(self, d_in: int = 13, d_hidden: int = 37, d_out: int = 5, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.norm = torch.nn.LayerNorm(d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)
        self.tiny = torch.nn.Parameter(torch.zeros(3))
        self.frozen = torch.nn.Parameter(torch.ones(d_out), requires_grad=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        h = self.norm(torch.nn.functional.gelu(self.fc1(x)))
        out = self.fc2(h) * self.frozen + self.tiny.sum()
        if y is None:
            return out
        return torch.nn.functional.mse_loss(out.float(), y.float())


def distinct_experts(moe: torch.nn.Module, ep_rank: int) -> None:
    """Scale the local experts of a DeepSpeed-style `MoE` (copies of one module) by 1 + 0.1 x their global
    index, so that experts differ and an expert in the wrong place shows in the losses."""
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    with torch.no_grad():
        for i, module in enumerate(experts):
            for p in module.parameters():
                p.mul_(1 + 0.1 * (ep_rank * len(experts) + i))


def regression_data(num_samples: int, d_in: int = 13, d_out: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, d_in, generator=g)
    w = torch.randn(d_in, d_out, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(num_samples, d_out, generator=g)
    return x, y
