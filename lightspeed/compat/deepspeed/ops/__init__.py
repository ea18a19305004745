"""`deepspeed.ops`: lightspeed's optimizers under DeepSpeed's module paths (`ops.adam.FusedAdam`, ...),
`sparse_attention` (block-sparse attention on FlexAttention), `op_builder` (DeepSpeed's extension
builders, none built) and `__compatible_ops__` /
`__installed_ops__` (git_version_info.py: every op False)."""

from lightspeed.compat.deepspeed.git_version_info import compatible_ops as __compatible_ops__  # noqa: F401
from lightspeed.compat.deepspeed.git_version_info import installed_ops as __installed_ops__  # noqa: F401
from lightspeed.compat.deepspeed.ops import adagrad, adam, lamb, lion, op_builder, sparse_attention  # noqa: F401

__all__ = ["adagrad", "adam", "lamb", "lion", "op_builder", "sparse_attention"]
