"""`deepspeed.ops`: lightspeed's optimizers under DeepSpeed's module paths (`ops.adam.FusedAdam`, ...)."""

from lightspeed.compat.deepspeed.ops import adagrad, adam, lamb, lion  # noqa: F401

__all__ = ["adagrad", "adam", "lamb", "lion"]
