"""Block-sparse self-attention, DeepSpeed's `deepspeed.ops.sparse_attention` API, on PyTorch
FlexAttention (no Triton 1.x kernels, nothing to build).

`sparsity_config.py` holds the layouts (the `SparsityConfig` kinds), `sparse_self_attention.py` the
module, `flex.py` the FlexAttention path (layout -> BlockMask, masks -> score_mod), `reference.py` the
dense masked spec (and the CPU path), `bert_sparse_self_attention.py` the BERT layer and its HF
variant, `sparse_attention_utils.py` DeepSpeed's helpers for HF BERT / RoBERTa. The `sparse_attention`
config section builds a layout through `sparsity_config_from_dict`.
"""

from .bert_sparse_self_attention import BertSparseSelfAttention, HFBertSparseSelfAttention
from .sparse_attention_utils import SparseAttentionUtils
from .sparse_self_attention import SparseSelfAttention
from .sparsity_config import (BigBirdSparsityConfig, BSLongformerSparsityConfig, DenseSparsityConfig,
                              FixedSparsityConfig, LocalSlidingWindowSparsityConfig, SparsityConfig,
                              VariableSparsityConfig, sparsity_config_from_dict)

__all__ = ["BSLongformerSparsityConfig", "BertSparseSelfAttention", "BigBirdSparsityConfig", "DenseSparsityConfig",
           "FixedSparsityConfig", "HFBertSparseSelfAttention", "LocalSlidingWindowSparsityConfig",
           "SparseAttentionUtils", "SparseSelfAttention", "SparsityConfig", "VariableSparsityConfig",
           "sparsity_config_from_dict"]
