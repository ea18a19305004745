"""Block-sparse self-attention on PyTorch FlexAttention: the layout becomes a `BlockMask`, DeepSpeed's
masks and relative position term a `score_mod`.

Owns: `layout_block_mask` (the BlockMask of a layout, built from the layout itself, never by
evaluating a mask over L x L) and `sparse_attention` (the forward: compiled `flex_attention` on CUDA,
the eager one elsewhere). Must not: hold module state (sparse_self_attention.py caches block masks).

Note: [tiles] FlexAttention's kernels work on tiles of `tile_size(block)` = lcm(block, 128) tokens. A
tile whose layout blocks are all 1 is a "full" tile (no mask evaluated in it), one with some 1s is a
"partial" tile (the mask_mod, layout[h, q // block, kv // block], decides per element), and tiles
with none are skipped. With DeepSpeed's usual block of 16 a tile holds 8 x 8 layout blocks; with a
block of 128 (or a multiple) tiles are exactly the layout's blocks and every computed tile is full.
Sequence lengths that are not a multiple of the tile are padded in the layout with zero blocks, so
the mask_mod never reads outside it and the padding tile is partial.

Note: [score_mod] The scale is flex_attention's `scale` (head_dim ** -0.5, as DeepSpeed); the
score_mod then adds rpe[b, h, q, kv], the key-padding mask (b, kv) and the attention mask (q, kv)
("add"), or sends the score to -inf where a "mul" mask is 0: reference.py's Note: [semantics]. The
masks and rpe are read without gradient, as DeepSpeed's kernel gives none for them.

Note: [backward tiles with a score_mod] With rpe or masks (a score_mod reading captured tensors) on
CUDA, the backward's tiles are set to 64 x 64 in both of its loops and the pipeline to 2 stages
(`_SCORE_MOD_TILES`, passed as flex_attention's kernel_options). Torch's default backward configuration
for bf16, head_dim 64 on sm90 (64 x 128 / 128 x 64 tiles, 3 stages) failed to compile on an H200 for
lack of shared memory (311,296 > 232,448 bytes) with DeepSpeed's rpe and masks; 64 x 64 tiles in 2
stages is what torch picks for the same head size on sm8x. Without a score_mod torch's defaults stand.

Note: [compiled once per shape] On CUDA one `torch.compile(flex_attention, dynamic=False)` serves every
module; each new sequence length (or set of masks given) is a recompile, and past dynamo's recompile
limit (`torch._dynamo.config.recompile_limit`, 8 by default) torch runs flex_attention unfused, which
materialises L x L scores. Runs that see many lengths should pad to a few (pad_to_block_size with a
coarser block) or raise that limit.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = ["layout_block_mask", "sparse_attention", "tile_size"]

_FLEX_TILE = 128
_SCORE_MOD_TILES = {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64, "num_stages": 2}
_compiled = None


def tile_size(block: int) -> int:
    """FlexAttention tile (BlockMask BLOCK_SIZE) used for a layout block of `block` tokens."""
    return block * _FLEX_TILE // math.gcd(block, _FLEX_TILE)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count per row, column indices with the set ones first) of a bool [..., rows, cols] tile map."""
    counts = dense.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, indices


def layout_block_mask(layout: torch.Tensor, block: int, seq_len: int, device) -> BlockMask:
    """The BlockMask of an int [H, L / block, L / block] layout for sequences of `seq_len` tokens. One
    head's mask when every head has the same layout (flex broadcasts it)."""
    layout = layout.bool()
    if layout.shape[0] > 1 and bool((layout == layout[:1]).all()):
        layout = layout[:1]
    shared = layout.shape[0] == 1
    tile = tile_size(block)
    per_tile = tile // block
    tiles = -(-layout.shape[-1] // per_tile)
    pad = tiles * per_tile - layout.shape[-1]
    padded = torch.nn.functional.pad(layout, (0, pad, 0, pad)) if pad else layout
    grid = padded.reshape(padded.shape[0], tiles, per_tile, tiles, per_tile)
    any_set = grid.any(dim=4).any(dim=2)
    all_set = grid.all(dim=4).all(dim=2)
    partial = any_set & ~all_set
    kv_num, kv_idx = _ordered(partial[None])
    full_num, full_idx = _ordered(all_set[None])
    lay = padded.to(device)

    if shared:
        def mask_mod(b, h, q_idx, kv_idx):
            return lay[0, q_idx // block, kv_idx // block]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return lay[h, q_idx // block, kv_idx // block]

    return BlockMask.from_kv_blocks(kv_num.to(device), kv_idx.to(device), full_num.to(device), full_idx.to(device),
                                    BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=(seq_len, seq_len))


def _score_mod(rpe, key_padding_mask, attn_mask, kpm_mode: str, am_mode: str):
    if rpe is None and key_padding_mask is None and attn_mask is None:
        return None
    if rpe is not None:
        rpe = rpe.detach()
        while rpe.dim() < 4:
            rpe = rpe.unsqueeze(0)
        rpe_b, rpe_h = rpe.shape[0] > 1, rpe.shape[1] > 1
    kpm = key_padding_mask.detach() if key_padding_mask is not None else None
    am = attn_mask.detach() if attn_mask is not None else None
    neg_inf = float("-inf")

    def score_mod(score, b, h, q_idx, kv_idx):
        if rpe is not None:
            score = score + rpe[b if rpe_b else 0, h if rpe_h else 0, q_idx, kv_idx]
        if kpm is not None:
            value = kpm[b, kv_idx]
            score = score + value if kpm_mode == "add" else torch.where(value == 0, neg_inf, score)
        if am is not None:
            value = am[q_idx, kv_idx]
            score = score + value if am_mode == "add" else torch.where(value == 0, neg_inf, score)
        return score

    return score_mod


def _flex(query: torch.Tensor):
    global _compiled
    if not query.is_cuda:
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def sparse_attention(query, key, value, block_mask: BlockMask, scale: float, rpe=None, key_padding_mask=None,
                     attn_mask=None, key_padding_mask_mode: str = "add", attn_mask_mode: str = "mul"):
    """[B, H, L, D] attention output; arguments as reference.sparse_attention, the layout as its
    `layout_block_mask`."""
    score_mod = _score_mod(rpe, key_padding_mask, attn_mask, key_padding_mask_mode, attn_mask_mode)
    with warnings.catch_warnings():
        # off CUDA the unfused (eager) flex_attention is the chosen path, not an accident to warn about
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        options = _SCORE_MOD_TILES if score_mod is not None and query.is_cuda else None
        return _flex(query)(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            kernel_options=options)
