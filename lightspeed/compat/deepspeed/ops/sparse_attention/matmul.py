"""`deepspeed.ops.sparse_attention.matmul`: DeepSpeed's stand-alone block-sparse `MatMul` kernel (Triton
1.x) is not built; `SparseSelfAttention` computes the same attention on FlexAttention."""

from lightspeed.compat.deepspeed._missing import missing_class

MatMul = missing_class("deepspeed.ops.sparse_attention.matmul.MatMul",
                       "the stand-alone block-sparse matmul kernel (use SparseSelfAttention)")

__all__ = ["MatMul"]
