"""Block-sparsity layouts of self-attention: DeepSpeed's `SparsityConfig` family, with its constructor
arguments, attribute names, validation and `make_layout(seq_len)` results.

Owns: the six kinds (Dense, Fixed, Variable, BigBird, BSLongformer, LocalSlidingWindow) and the
layout they produce, an int64 tensor [num_heads, seq_len // block, seq_len // block] whose 1s are the
(query block, key block) pairs a head computes; `sparsity_config_from_dict`, which builds one from
the per-mode dict the `sparse_attention` config section gives (`deepspeed_dict()`).
Must not: run attention (sparse_self_attention.py does), or seed anything.

Note: [randomness] Variable and BigBird draw random key blocks per query-block row with Python's
global `random` module, exactly as DeepSpeed does: for each layout head in order, one
`random.sample(range(...), num_random_blocks)` per row, before the local / window / global parts.
So `random.seed(s)` followed by `make_layout(n)` gives the same layout as DeepSpeed after the same
seed. The layout is drawn once, when `SparseSelfAttention` is built (at its `max_seq_length`); ranks of
a distributed run must agree on it (see sparse_self_attention.py's Note: [layout on every rank]).

Note: [heads] Unless `different_layout_per_head`, only head 0 is computed and copied to every head
(`check_and_propagate_first_head_layout`); `num_layout_heads` is 1 then. `torch.tril` in the
unidirectional BigBird / BSLongformer layouts applies to every head, as in DeepSpeed.
"""

from __future__ import annotations

import random

import torch

__all__ = ["BSLongformerSparsityConfig", "BigBirdSparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
           "LocalSlidingWindowSparsityConfig", "SparsityConfig", "VariableSparsityConfig",
           "sparsity_config_from_dict"]

_DIRECTIONS = ("unidirectional", "bidirectional")


def _check_direction(attention) -> None:
    if attention not in _DIRECTIONS:
        raise NotImplementedError(f"attention must be 'unidirectional' or 'bidirectional', got {attention!r}")


def _check_global_ranges(starts, ends) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(f"global_block_indices ({len(starts)} entries) and global_block_end_indices "
                         f"({len(ends)} entries) must have the same length")
    for start, end in zip(starts, ends):
        if start >= end:
            raise ValueError(f"global block range [{start}, {end}) is empty: each start index must be smaller "
                             "than its end index")


def _need_blocks(num_blocks: int, wanted: int, what: str) -> None:
    if num_blocks < wanted:
        raise ValueError(f"{what} ({wanted}) exceeds the number of blocks in a row ({num_blocks})")


class SparsityConfig:
    """What every layout kind shares: `num_heads`, `block` (the side of a square block, in tokens) and
    `different_layout_per_head`. Subclasses implement `make_layout(seq_len)`."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len):
        """An all-zero int64 layout [num_heads, seq_len // block, seq_len // block]."""
        if seq_len % self.block != 0:
            raise ValueError(f"sequence length {seq_len} is not a multiple of the block size {self.block}")
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout):
        """Copy head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:self.num_heads] = layout[0]
        return layout

    def make_layout(self, seq_len):
        raise NotImplementedError(f"{type(self).__name__} defines no layout: use one of its kinds (DenseSparsityConfig, "
                                  "FixedSparsityConfig, VariableSparsityConfig, BigBirdSparsityConfig, "
                                  "BSLongformerSparsityConfig, LocalSlidingWindowSparsityConfig)")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "num_layout_heads")
        return f"{type(self).__name__}({fields})"


class DenseSparsityConfig(SparsityConfig):
    """Every block computed: dense attention through the sparse path (for comparison)."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False):
        super().__init__(num_heads, block, different_layout_per_head)

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        layout.fill_(1)
        return layout


class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformer's "fixed" pattern (Child et al., 2019): blocks attend within local windows of
    `num_local_blocks`; the last `num_global_blocks` of each window (head h of
    `num_different_global_patterns` patterns: shifted left by h % patterns windows' worth of global
    blocks) are attended by every row (and attend to every column with `horizontal_global_attention`)."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_local_blocks=4, num_global_blocks=1,
                 attention="bidirectional", horizontal_global_attention=False, num_different_global_patterns=1):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = num_local_blocks
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(f"num_local_blocks ({num_local_blocks}) must be a multiple of num_global_blocks "
                             f"({num_global_blocks})")
        self.num_global_blocks = num_global_blocks
        _check_direction(attention)
        self.attention = attention
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = horizontal_global_attention
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head=True (one layout "
                             "shared by all heads has one global pattern)")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(f"num_different_global_patterns ({num_different_global_patterns}) cannot exceed "
                             f"num_local_blocks // num_global_blocks ({num_local_blocks // num_global_blocks})")
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h, layout):
        n = layout.shape[1]
        causal = self.attention == "unidirectional"
        for lo in range(0, n, self.num_local_blocks):
            hi = min(lo + self.num_local_blocks, n)
            for row in range(lo, hi):
                layout[h, row, lo:(row + 1 if causal else hi)] = 1
        return layout

    def _set_global_columns(self, h, layout, lo, hi):
        first_row = 0 if self.attention == "bidirectional" else lo
        layout[h, first_row:, lo:hi] = 1
        if self.horizontal_global_attention:
            layout[h, lo:hi, :] = 1

    def set_global_layout(self, h, layout):
        n = layout.shape[1]
        offset = self.num_local_blocks - (1 + h % self.num_different_global_patterns) * self.num_global_blocks
        whole = n - n % self.num_local_blocks  # blocks covered by complete local windows
        for lo in range(offset, whole, self.num_local_blocks):
            self._set_global_columns(h, layout, lo, lo + self.num_global_blocks)
        if whole < n:  # a short last window: its global blocks, pulled back to fit
            lo = min(whole + offset, n - self.num_global_blocks)
            self._set_global_columns(h, layout, lo, lo + self.num_global_blocks)
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class VariableSparsityConfig(SparsityConfig):
    """Fixed, generalised: `num_random_blocks` random key blocks per row, local windows of the sizes in
    `local_window_blocks` (the last size repeats to the end), and global blocks at
    `global_block_indices` (or the ranges [start, end) with `global_block_end_indices`)."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_random_blocks=0,
                 local_window_blocks=[4], global_block_indices=[0], global_block_end_indices=None,  # noqa: B006
                 attention="bidirectional", horizontal_global_attention=False):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = local_window_blocks
        self.global_block_indices = global_block_indices
        _check_global_ranges(global_block_indices, global_block_end_indices)
        self.global_block_end_indices = global_block_end_indices
        _check_direction(attention)
        self.attention = attention
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.horizontal_global_attention = horizontal_global_attention

    def set_random_layout(self, h, layout):
        n = layout.shape[1]
        _need_blocks(n, self.num_random_blocks, "num_random_blocks")
        for row in range(n):
            layout[h, row, random.sample(range(0, n), self.num_random_blocks)] = 1
        return layout

    def _fill_window(self, h, layout, lo, hi):
        causal = self.attention == "unidirectional"
        for row in range(lo, hi):
            layout[h, row, lo:(row + 1 if causal else hi)] = 1

    def set_local_layout(self, h, layout):
        n = layout.shape[1]
        lo = 0
        size = None
        for size in self.local_window_blocks:
            self._fill_window(h, layout, lo, min(lo + size, n))
            lo += size
        if size is None:
            raise ValueError("local_window_blocks is empty: give at least one local window size")
        for start in range(lo, n, size):  # the rest of the sequence in windows of the last size
            self._fill_window(h, layout, start, min(start + size, n))
        return layout

    def set_global_layout(self, h, layout):
        n = layout.shape[1]
        if self.global_block_end_indices is None:
            ranges = [(idx, idx) for idx in self.global_block_indices]
        else:
            ranges = list(zip(self.global_block_indices, self.global_block_end_indices))
        for start, end in ranges:
            if start >= n:
                continue
            first_row = 0 if self.attention == "bidirectional" else start
            if self.global_block_end_indices is None:  # one block: integer indexing, as DeepSpeed does
                if self.horizontal_global_attention:
                    layout[h, start, :] = 1
                layout[h, first_row:, start] = 1
            else:
                end = min(end, n)
                if self.horizontal_global_attention:
                    layout[h, start:end, :] = 1
                layout[h, first_row:, start:end] = 1
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


def _sliding_window(layout, h, window, causal):
    n = layout.shape[1]
    _need_blocks(n, window, "num_sliding_window_blocks")
    half = window // 2
    for row in range(n):
        layout[h, row, max(0, row - half):(row + 1 if causal else min(row + half + 1, n))] = 1
    return layout


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al., 2020), block-sparse: `num_random_blocks` random key blocks per row (drawn
    from the row's past under unidirectional attention), a sliding window of `num_sliding_window_blocks`
    centred on the diagonal, and the first `num_global_blocks` rows and columns."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_random_blocks=1,
                 num_sliding_window_blocks=3, num_global_blocks=1, attention="bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        _check_direction(attention)
        self.attention = attention

    def set_random_layout(self, h, layout):
        n = layout.shape[1]
        _need_blocks(n, self.num_random_blocks, "num_random_blocks")
        for row in range(n):
            pool = range(0, n) if self.attention == "bidirectional" else range(0, row + 1)
            layout[h, row, random.sample(pool, self.num_random_blocks)] = 1
        return layout

    def set_sliding_window_layout(self, h, layout):
        return _sliding_window(layout, h, self.num_sliding_window_blocks, causal=False)

    def set_global_layout_itc(self, h, layout):
        _need_blocks(layout.shape[1], self.num_global_blocks, "num_global_blocks")
        layout[h, :self.num_global_blocks, :] = 1
        layout[h, :, :self.num_global_blocks] = 1
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            layout = self.set_random_layout(h, layout)
            layout = self.set_sliding_window_layout(h, layout)
            layout = self.set_global_layout_itc(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Longformer (Beltagy et al., 2020), block-sparse: a sliding window of `num_sliding_window_blocks`
    plus global blocks at `global_block_indices` (or ranges with `global_block_end_indices`) that
    attend to and are attended by every block; `torch.tril` of it all under unidirectional attention."""

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_sliding_window_blocks=3,
                 global_block_indices=[0], global_block_end_indices=None, attention="bidirectional"):  # noqa: B006
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = global_block_indices
        self.attention = attention
        _check_global_ranges(global_block_indices, global_block_end_indices)
        self.global_block_end_indices = global_block_end_indices

    def set_sliding_window_layout(self, h, layout):
        return _sliding_window(layout, h, self.num_sliding_window_blocks, causal=False)

    def set_global_layout(self, h, layout):
        n = layout.shape[1]
        if self.global_block_end_indices is None:
            for idx in self.global_block_indices:
                if idx < n:
                    layout[h, idx, :] = 1
                    layout[h, :, idx] = 1
        else:
            for start, end in zip(self.global_block_indices, self.global_block_end_indices):
                if start < n:
                    end = min(end, n)
                    layout[h, start:end, :] = 1
                    layout[h, :, start:end] = 1
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return layout

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            layout = self.set_sliding_window_layout(h, layout)
            layout = self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window of `num_sliding_window_blocks` only; unidirectional (the default) keeps the
    window's past half and the diagonal. One layout for all heads."""

    def __init__(self, num_heads, block=16, num_sliding_window_blocks=3, attention="unidirectional"):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h, layout):
        return _sliding_window(layout, h, self.num_sliding_window_blocks, causal=self.attention != "bidirectional")

    def make_layout(self, seq_len):
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            layout = self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


_KINDS = {"dense": DenseSparsityConfig, "fixed": FixedSparsityConfig, "variable": VariableSparsityConfig,
          "bigbird": BigBirdSparsityConfig, "bslongformer": BSLongformerSparsityConfig}


def sparsity_config_from_dict(sparse_attention: dict, num_heads: int) -> SparsityConfig:
    """The `SparsityConfig` a `sparse_attention` section describes (DeepSpeed's per-mode dict, as
    `DeepSpeedConfig.sparse_attention` / `SparseAttentionConfig.deepspeed_dict()` give it: `mode` plus
    that mode's keys) for a layer of `num_heads` heads."""
    params = dict(sparse_attention)
    mode = params.pop("mode", "fixed")
    if mode not in _KINDS:
        raise ValueError(f"sparse_attention.mode must be one of {sorted(_KINDS)}, got {mode!r}")
    return _KINDS[mode](num_heads=num_heads, **params)
