"""`BertSparseSelfAttention`: a BERT self-attention layer (query / key / value projections) whose
attention is `SparseSelfAttention`; `HFBertSparseSelfAttention`, the same layer speaking Hugging Face
transformers' self-attention protocol, which `SparseAttentionUtils` installs in HF BERT / RoBERTa.

Owns: the projections, the head split / merge, and (HF variant) turning HF's attention mask into the
key-padding mask. Must not: know the layout kinds (any `SparsityConfig` is taken).

Note: [HF protocol] transformers 5.x calls `layer.attention.self(hidden_states, attention_mask=...,
**kwargs)` and unpacks `(context, attention_weights)`. Its mask is None (no padding), or [B, 1, Lq, Lk]
(or [B, 1, 1, Lk]): boolean (True = attend; the sdpa / flash builders) or additive float (0 / dtype
minimum; the eager builder). Sparse attention takes one key-padding mask per batch row, so every
query row of the mask must be the same (a bidirectional padding mask is); a causal or otherwise
per-query mask is refused, as is a flex `BlockMask`. The weights returned are None: sparse attention
never forms the probability matrix. Like DeepSpeed's layer, it applies no attention-probability
dropout (HF's layer does, in training).
"""

from __future__ import annotations

import torch
from torch import nn

from .sparse_self_attention import SparseSelfAttention
from .sparsity_config import FixedSparsityConfig, SparsityConfig

__all__ = ["BertSparseSelfAttention", "HFBertSparseSelfAttention"]


class BertSparseSelfAttention(nn.Module):
    """`BertSparseSelfAttention(config, sparsity_config=FixedSparsityConfig(num_heads=4))`, `config` with
    `hidden_size` and `num_attention_heads`; `forward(hidden_states, attention_mask)` ->
    [B, L, hidden] context, `attention_mask` DeepSpeed's key-padding mask (squeezes to [B, L], added
    to the scores)."""

    attention_class = SparseSelfAttention

    def __init__(self, config, sparsity_config: SparsityConfig | None = None, *, max_seq_length: int = 2048):
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(f"hidden_size ({config.hidden_size}) is not a multiple of num_attention_heads "
                             f"({config.num_attention_heads})")
        if sparsity_config is None:
            sparsity_config = FixedSparsityConfig(num_heads=4)
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.sparse_self_attention = self.attention_class(sparsity_config, max_seq_length=max_seq_length)

    def transpose_for_scores(self, x):
        """[B, L, hidden] -> [B, heads, L, head_size]."""
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def _context(self, hidden_states, key_padding_mask):
        query = self.transpose_for_scores(self.query(hidden_states))
        key = self.transpose_for_scores(self.key(hidden_states))
        value = self.transpose_for_scores(self.value(hidden_states))
        context = self.sparse_self_attention(query, key, value, key_padding_mask=key_padding_mask)
        context = context.permute(0, 2, 1, 3).contiguous()
        return context.view(*context.shape[:-2], self.all_head_size)

    def forward(self, hidden_states, attention_mask):
        return self._context(hidden_states, attention_mask)


def _key_padding_from_hf(mask, dtype: torch.dtype):
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise NotImplementedError(f"sparse self-attention takes a tensor attention mask, not {type(mask).__name__} "
                                  "(load the model with attn_implementation='eager' or 'sdpa')")
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"expected HF's [batch, 1, q_len, k_len] attention mask, got shape {tuple(mask.shape)}")
    rows = mask[:, 0]
    if rows.shape[1] > 1 and not bool((rows == rows[:, :1]).all()):
        raise NotImplementedError("sparse self-attention takes a key-padding mask (the same for every query "
                                  "row); this attention mask differs per query (causal or custom)")
    keys = rows[:, 0]
    if keys.dtype == torch.bool:
        return torch.zeros(keys.shape, dtype=dtype, device=keys.device).masked_fill(~keys, torch.finfo(dtype).min)
    return keys.to(dtype)


class HFBertSparseSelfAttention(BertSparseSelfAttention):
    """BertSparseSelfAttention under transformers' self-attention calling convention (Note: [HF
    protocol]): `forward(hidden_states, attention_mask=None, **kwargs)` -> (context, None)."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise NotImplementedError("sparse self-attention has no key/value cache (decoder use)")
        return self._context(hidden_states, _key_padding_from_hf(attention_mask, hidden_states.dtype)), None
