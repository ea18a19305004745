"""The spec of block-sparse self-attention: dense scores, DeepSpeed's masks, a masked softmax, in plain
torch. It materialises [B, H, L, L] scores, so it is for checking and small inputs.

Owns: `expand_layout` (block layout to element mask), `sparse_attention` (the reference forward) and
`prepare_masks` (DeepSpeed's squeezing and dtype of the two masks, shared with the FlexAttention path).
Must not: know about FlexAttention.

Note: [semantics] For query i, key j of head h in batch b, with s the softmax scale:
    score = (q . k) * s + rpe[b, h, i, j] + kpm(b, j) + am(i, j)   where layout[h, i // block, j // block] is 1
and the key is left out where the layout is 0. kpm / am are the key-padding mask ([B, L]) and the
attention mask ([L, L]): in mode "add" the mask's value is added; in mode "mul" a 0 leaves the key out
and anything else adds 0. Scores are fp32; the output has the query's dtype.

Note: [empty rows] A query row with no key left (no layout block in its row, or every key masked out)
gets a zero output row. DeepSpeed's kernel gives zeros for the first case and NaN for the second.
"""

from __future__ import annotations

import torch

__all__ = ["MASK_MODES", "expand_layout", "prepare_masks", "sparse_attention"]

MASK_MODES = ("add", "mul")


def expand_layout(layout: torch.Tensor, block: int) -> torch.Tensor:
    """Bool [H, L, L] element mask of a [H, L / block, L / block] block layout."""
    return layout.bool().repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)


def prepare_masks(dtype: torch.dtype, key_padding_mask, attn_mask, batch: int, seq_len: int):
    """DeepSpeed's mask handling: both masks cast to the query dtype; the key-padding mask loses every
    size-1 dim but the first (so [B, 1, 1, L] becomes [B, L]), the attention mask every size-1 dim.
    Returns ([B, L] or None, [L, L] or None); other shapes are refused."""
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(dtype)
        for d in range(kpm.dim() - 1, 0, -1):
            kpm = kpm.squeeze(d)
        if kpm.shape != (batch, seq_len):
            raise ValueError(f"key_padding_mask of shape {tuple(key_padding_mask.shape)} does not squeeze to "
                             f"[batch, seq_len] = [{batch}, {seq_len}]")
        key_padding_mask = kpm
    if attn_mask is not None:
        am = attn_mask.to(dtype).squeeze()
        if am.shape != (seq_len, seq_len):
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not squeeze to [seq_len, seq_len] "
                             f"= [{seq_len}, {seq_len}] (only one 2-D mask for all batches and heads is supported)")
        attn_mask = am
    return key_padding_mask, attn_mask


def _apply(scores: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    mask = mask.float()
    if mode == "add":
        return scores + mask
    return scores.masked_fill(mask == 0, float("-inf"))


def sparse_attention(query, key, value, layout, block: int, scale: float, rpe=None, key_padding_mask=None,
                     attn_mask=None, key_padding_mask_mode: str = "add", attn_mask_mode: str = "mul"):
    """[B, H, L, D] attention output under a [H, L / block, L / block] layout, per the module Notes.
    `key_padding_mask` [B, L] and `attn_mask` [L, L] as `prepare_masks` returns them; `rpe`
    broadcastable to [B, H, L, L]."""
    allowed = expand_layout(layout.to(query.device), block)[None]  # [1, H, L, L]
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if rpe is not None:
        scores = scores + rpe.float()
    if key_padding_mask is not None:
        scores = _apply(scores, key_padding_mask[:, None, None, :], key_padding_mask_mode)
    if attn_mask is not None:
        scores = _apply(scores, attn_mask[None, None], attn_mask_mode)
    scores = scores.masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return torch.matmul(probs, value.float()).to(query.dtype)
