"""`SparseSelfAttention`: DeepSpeed's block-sparse self-attention module, on FlexAttention.

Owns: the module (its constructor and forward signatures and DeepSpeed's behaviour: the master layout
drawn once at `max_seq_length` and sliced per length, the key transposition, the mask squeezing and
modes, the head_dim ** -0.5 scale) and the choice of path. Must not: communicate itself (a layout
broadcast is injected: Note: [layout on every rank]).

Note: [paths] "flex": `flex.sparse_attention` (compiled flex_attention for CUDA tensors; off CUDA the
eager, unfused one, which has no backward in torch, so forward only); "reference":
`reference.sparse_attention` (dense scores, masked: the CPU path). "auto" picks "flex" for CUDA
tensors and "reference" otherwise; `backend=` forces one; so does LIGHTSPEED_OPS_BACKEND ("reference",
or "flex" / "triton": flex's CUDA kernels are Triton's; its "auto" and "torch" leave the choice
automatic); other values are refused. Unlike DeepSpeed's Triton kernels, which took fp16 only, every
path takes fp32, fp16 and bf16.

Note: [layout on every rank] DeepSpeed broadcasts the master layout from global rank 0 on first use,
so that random layouts (Variable, BigBird) agree across ranks. `layout_broadcast` (a class attribute:
a callable that overwrites a tensor in place with rank 0's, or None) does it here; lightspeed's
`deepspeed.ops.sparse_attention` sets it to a broadcast through lightspeed.comm when a process group is
up. Without it, ranks agree when they seeded `random` alike before building the module.
"""

from __future__ import annotations

import os
from typing import Callable, ClassVar, Optional

import torch
from torch import nn

from . import flex, reference
from .sparsity_config import SparsityConfig

__all__ = ["BACKENDS", "SparseSelfAttention"]

BACKENDS = ("auto", "flex", "reference")


# LIGHTSPEED_OPS_BACKEND is shared by every op family: its values map onto this family's paths
_ENV_BACKENDS = {"auto": "auto", "torch": "auto", "triton": "flex", "flex": "flex", "reference": "reference"}


def _backend(chosen: Optional[str], query: torch.Tensor) -> str:
    if chosen is not None:
        if chosen not in BACKENDS:
            raise ValueError(f"sparse attention backend must be one of {BACKENDS}, got {chosen!r}")
        backend = chosen
    else:
        env = os.environ.get("LIGHTSPEED_OPS_BACKEND") or "auto"
        if env not in _ENV_BACKENDS:
            raise ValueError(f"LIGHTSPEED_OPS_BACKEND must be one of {sorted(_ENV_BACKENDS)}, got {env!r}")
        backend = _ENV_BACKENDS[env]
    if backend == "auto":
        return "flex" if query.is_cuda else "reference"
    return backend


class SparseSelfAttention(nn.Module):
    """`SparseSelfAttention(sparsity_config, key_padding_mask_mode="add", attn_mask_mode="mul",
    max_seq_length=2048)`; `forward(query, key, value, rpe=None, key_padding_mask=None, attn_mask=None)`
    on [batch, heads, seq_len, head_dim] tensors (key may come transposed, [B, H, D, L]); seq_len a
    multiple of the block. lightspeed adds `backend=` (Note: [paths])."""

    layout_broadcast: ClassVar[Optional[Callable[[torch.Tensor], None]]] = None

    def __init__(self, sparsity_config: Optional[SparsityConfig] = None, key_padding_mask_mode: str = "add",
                 attn_mask_mode: str = "mul", max_seq_length: int = 2048, *, backend: Optional[str] = None):
        super().__init__()
        if sparsity_config is None:
            raise ValueError("SparseSelfAttention needs a sparsity_config (a SparsityConfig kind such as "
                             "FixedSparsityConfig(num_heads=...)): the base SparsityConfig has no layout")
        for name, mode in (("key_padding_mask_mode", key_padding_mask_mode), ("attn_mask_mode", attn_mask_mode)):
            if mode not in reference.MASK_MODES:
                raise ValueError(f"{name} must be 'add' or 'mul', got {mode!r}")
        self.sparsity_config = sparsity_config
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length))
        self._need_layout_synchronization = True
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self.backend = backend
        self._block_masks: dict = {}

    def get_layout(self, L: int) -> torch.Tensor:
        """The [H, L / block, L / block] layout for sequences of L tokens (the master layout's corner)."""
        if self._need_layout_synchronization:
            broadcast = type(self).layout_broadcast
            if broadcast is not None:
                broadcast(self.master_layout)
                self._block_masks.clear()
            self._need_layout_synchronization = False
        block = self.sparsity_config.block
        if L % block != 0:
            raise ValueError(f"sequence length {L} is not a multiple of the sparse block size {block}")
        num_blocks = L // block
        if num_blocks > self.master_layout.shape[-1]:
            raise ValueError(f"sequence length {L} exceeds the max_seq_length "
                             f"{self.master_layout.shape[-1] * block} this module's layout was made for")
        return self.master_layout[..., :num_blocks, :num_blocks].cpu()

    def _block_mask(self, L: int, device: torch.device):
        key = (L, device)
        if key not in self._block_masks:
            self._block_masks[key] = flex.layout_block_mask(self.get_layout(L), self.sparsity_config.block, L, device)
        return self._block_masks[key]

    def _load_from_state_dict(self, *args, **kwargs):
        self._block_masks.clear()  # a loaded master_layout replaces the one the cached masks encode
        super()._load_from_state_dict(*args, **kwargs)

    def transpose_key_for_scores(self, x, L):
        """DeepSpeed's rule: a key whose dim 2 is not the sequence length is taken as [B, H, D, L]."""
        return x.permute(0, 1, 3, 2) if x.size(2) != L else x

    def forward(self, query, key, value, rpe=None, key_padding_mask=None, attn_mask=None):
        if query.dim() != 4:
            raise ValueError(f"query must be [batch, heads, seq_len, head_dim], got shape {tuple(query.shape)}")
        bsz, num_heads, tgt_len, head_dim = query.size()
        key = self.transpose_key_for_scores(key, tgt_len)
        if query.shape != key.shape or key.shape != value.shape:
            raise NotImplementedError(f"only self-attention is supported: query {tuple(query.shape)}, key "
                                      f"{tuple(key.shape)} and value {tuple(value.shape)} must have one shape")
        if num_heads != self.master_layout.shape[0]:
            raise ValueError(f"query has {num_heads} heads but the sparsity config was made for "
                             f"{self.master_layout.shape[0]}")
        key_padding_mask, attn_mask = reference.prepare_masks(query.dtype, key_padding_mask, attn_mask, bsz, tgt_len)
        if rpe is not None:
            if rpe.dtype != query.dtype:
                raise ValueError(f"rpe must have the query's dtype {query.dtype}, got {rpe.dtype}")
            if rpe.dim() > 4 or tuple(rpe.shape[-2:]) != (tgt_len, tgt_len):
                raise ValueError(f"rpe must be [batch, heads, seq_len, seq_len] (batch and heads may be 1), got "
                                 f"shape {tuple(rpe.shape)} for seq_len {tgt_len}")
        scale = float(head_dim) ** -0.5
        extras = dict(rpe=rpe, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                      key_padding_mask_mode=self.key_padding_mask_mode, attn_mask_mode=self.attn_mask_mode)
        if _backend(self.backend, query) == "reference":
            return reference.sparse_attention(query, key, value, self.get_layout(tgt_len), self.sparsity_config.block,
                                              scale, **extras)
        return flex.sparse_attention(query, key, value, self._block_mask(tgt_len, query.device), scale, **extras)
