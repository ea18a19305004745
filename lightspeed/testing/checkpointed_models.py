"""A tiny residual network with dropout (on the default stream and on the RNG tracker's model-parallel
stream) whose blocks run plain or through one of the checkpoint functions: the model the activation
checkpointing tests compare, plain against checkpointed, at every ZeRO stage."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightspeed.checkpointing import checkpoint, get_cuda_rng_tracker, non_reentrant_checkpoint

MODES = ("plain", "reentrant", "non_reentrant", "torch", "torch_non_reentrant")


class DropoutBlock(torch.nn.Module):
    def __init__(self, dim: int, p: float = 0.3, tracked: bool = True):
        super().__init__()
        self.tracked = tracked
        self.fc1 = torch.nn.Linear(dim, 2 * dim)
        self.fc2 = torch.nn.Linear(2 * dim, dim)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.tracked:  # a model-parallel region's dropout draws from the tracked stream
            with get_cuda_rng_tracker().fork():
                h = F.dropout(h, self.p, self.training)
        return x + F.dropout(self.fc2(h), self.p, self.training)


class CheckpointedNet(torch.nn.Module):
    """An input linear, `num_blocks` DropoutBlocks and a linear head; `mode` picks how each block runs: "plain",
    "reentrant" (`checkpoint`), "non_reentrant" (`non_reentrant_checkpoint`), "torch" or
    "torch_non_reentrant" (torch.utils.checkpoint, as Hugging Face's gradient checkpointing calls it). `tracked`:
    the blocks also drop out on the RNG tracker's stream, which torch.utils.checkpoint does not replay
    (lightspeed's and DeepSpeed's checkpoints do), so the "torch" modes need `tracked=False`."""

    def __init__(self, mode: str = "plain", dim: int = 8, num_blocks: int = 3, seed: int = 0, tracked: bool = True):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
        self.mode = mode
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(dim, dim)  # the first block's input needs grad: a reentrant checkpoint requires it
        self.blocks = torch.nn.ModuleList(DropoutBlock(dim, tracked=tracked) for _ in range(num_blocks))
        self.head = torch.nn.Linear(dim, 1)

    def _run(self, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "reentrant":
            return checkpoint(block, x)
        if self.mode == "non_reentrant":
            return non_reentrant_checkpoint(block, x)
        if self.mode in ("torch", "torch_non_reentrant"):
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.mode == "torch")
        return block(x)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = self._run(block, x)
        return F.mse_loss(self.head(x), y)
