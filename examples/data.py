"""The demo's data: a byte-level tokenizer and (input, target) windows over a text corpus.

Bytes are the tokens (vocab 256), so there is nothing to download or train and any UTF-8 text works.
The corpus is split by position (the first 90% trains, the last 10% validates), and each split is cut
into fixed windows, so item ``i`` is the same on every rank and every run: shuffling and sharding
across ranks are the sampler's job (the engine's DistributedSampler), not the dataset's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "shakespeare.txt"


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; decoding replaces a split multi-byte character with U+FFFD."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(ids).decode("utf-8", errors="replace")


def load_tokens(path: str | Path = DEFAULT_CORPUS) -> torch.Tensor:
    """The file's bytes as a 1-D uint8 tensor (one token per byte)."""
    return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)


class TokenWindows(Dataset):
    """Windows of ``block_size + 1`` tokens starting every ``stride`` tokens (default: non-overlapping).

    Item i is ``(x, y)``, both (block_size,) int64, with ``y = tokens[s+1 : s+block_size+1]`` the
    input ``x = tokens[s : s+block_size]`` shifted by one, where ``s = i * stride``.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int | None = None):
        self.stride = stride or block_size
        if block_size < 1 or self.stride < 1:
            raise ValueError(f"block_size and stride must be positive (got {block_size}, {self.stride})")
        if tokens.numel() < block_size + 1:
            raise ValueError(f"{tokens.numel()} tokens cannot fill one window of {block_size} + 1")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = i * self.stride
        chunk = self.tokens[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def train_val_datasets(
    block_size: int,
    path: str | Path = DEFAULT_CORPUS,
    val_fraction: float = 0.1,
    stride: int | None = None,
) -> tuple[TokenWindows, TokenWindows]:
    """Split the corpus at ``1 - val_fraction`` of its length; validation windows never overlap."""
    tokens = load_tokens(path)
    split = int(tokens.numel() * (1.0 - val_fraction))
    return TokenWindows(tokens[:split], block_size, stride), TokenWindows(tokens[split:], block_size)
