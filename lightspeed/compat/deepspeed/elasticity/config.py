"""`deepspeed.elasticity.config`: the elasticity errors (see `lightspeed.config.elasticity`)."""

from lightspeed.config.elasticity import (  # noqa: F401
    ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize,
)  # fmt: skip

__all__ = ["ElasticityConfigError", "ElasticityError", "ElasticityIncompatibleWorldSize"]
