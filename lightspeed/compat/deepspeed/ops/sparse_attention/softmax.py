"""`deepspeed.ops.sparse_attention.softmax`: DeepSpeed's stand-alone block-sparse `Softmax` kernel (Triton
1.x) is not built; `SparseSelfAttention` computes the same attention on FlexAttention."""

from lightspeed.compat.deepspeed._missing import missing_class

Softmax = missing_class("deepspeed.ops.sparse_attention.softmax.Softmax",
                        "the stand-alone block-sparse softmax kernel (use SparseSelfAttention)")

__all__ = ["Softmax"]
