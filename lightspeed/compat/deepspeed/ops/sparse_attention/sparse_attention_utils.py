"""`deepspeed.ops.sparse_attention.sparse_attention_utils`: `SparseAttentionUtils`, installing the compat
HF layer (whose layout is broadcast from rank 0)."""

from lightspeed.compat.deepspeed.ops.sparse_attention.bert_sparse_self_attention import HFBertSparseSelfAttention
from lightspeed.ops.sparse_attention import sparse_attention_utils as _ops


class SparseAttentionUtils(_ops.SparseAttentionUtils):
    __doc__ = _ops.SparseAttentionUtils.__doc__
    bert_attention_class = HFBertSparseSelfAttention


__all__ = ["SparseAttentionUtils"]
