"""`deepspeed.ops.sparse_attention`: DeepSpeed's block-sparse attention API on lightspeed's FlexAttention
implementation (lightspeed.ops.sparse_attention); the modules here broadcast random layouts from rank
0 as DeepSpeed does. Its stand-alone Triton kernels (`matmul.MatMul`, `softmax.Softmax`) are not built:
constructing one raises NotImplementedError."""

from lightspeed.compat.deepspeed.ops.sparse_attention.bert_sparse_self_attention import BertSparseSelfAttention
from lightspeed.compat.deepspeed.ops.sparse_attention.sparse_attention_utils import SparseAttentionUtils
from lightspeed.compat.deepspeed.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from lightspeed.compat.deepspeed.ops.sparse_attention.sparsity_config import (BigBirdSparsityConfig,
                                                                              BSLongformerSparsityConfig,
                                                                              DenseSparsityConfig,
                                                                              FixedSparsityConfig,
                                                                              LocalSlidingWindowSparsityConfig,
                                                                              SparsityConfig, VariableSparsityConfig)

__all__ = ["BSLongformerSparsityConfig", "BertSparseSelfAttention", "BigBirdSparsityConfig", "DenseSparsityConfig",
           "FixedSparsityConfig", "LocalSlidingWindowSparsityConfig", "SparseAttentionUtils", "SparseSelfAttention",
           "SparsityConfig", "VariableSparsityConfig"]
