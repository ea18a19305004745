"""`deepspeed.ops.sparse_attention.sparsity_config`: the layout kinds (lightspeed.ops.sparse_attention)."""

from lightspeed.ops.sparse_attention.sparsity_config import (BigBirdSparsityConfig, BSLongformerSparsityConfig,
                                                              DenseSparsityConfig, FixedSparsityConfig,
                                                              LocalSlidingWindowSparsityConfig, SparsityConfig,
                                                              VariableSparsityConfig)

__all__ = ["BSLongformerSparsityConfig", "BigBirdSparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig",
           "LocalSlidingWindowSparsityConfig", "SparsityConfig", "VariableSparsityConfig"]
