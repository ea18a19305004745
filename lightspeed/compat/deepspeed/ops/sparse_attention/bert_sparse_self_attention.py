"""`deepspeed.ops.sparse_attention.bert_sparse_self_attention`: `BertSparseSelfAttention` over the
compat `SparseSelfAttention` (whose layout is broadcast from rank 0)."""

from lightspeed.compat.deepspeed.ops.sparse_attention.sparse_self_attention import SparseSelfAttention
from lightspeed.ops.sparse_attention import bert_sparse_self_attention as _ops


class BertSparseSelfAttention(_ops.BertSparseSelfAttention):
    __doc__ = _ops.BertSparseSelfAttention.__doc__
    attention_class = SparseSelfAttention


class HFBertSparseSelfAttention(_ops.HFBertSparseSelfAttention):
    __doc__ = _ops.HFBertSparseSelfAttention.__doc__
    attention_class = SparseSelfAttention


__all__ = ["BertSparseSelfAttention", "HFBertSparseSelfAttention"]
