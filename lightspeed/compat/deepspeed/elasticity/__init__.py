"""`deepspeed.elasticity`: see `lightspeed.config.elasticity` (DeepSpeed's elastic batch sizes, versions 0.1 and
0.2). DeepSpeed's `DSElasticAgent` is not here: `lightspeed --elastic_training` runs torch's elastic agent."""

from lightspeed.compat.deepspeed.elasticity.config import (  # noqa: F401
    ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize,
)  # fmt: skip
from lightspeed.config.elasticity import (  # noqa: F401
    check_scheduler_config as ensure_immutable_elastic_config, compute_elastic_config, elasticity_enabled,
)  # fmt: skip

ELASTICITY = "elasticity"
ENABLED = "enabled"
ENABLED_DEFAULT = False

__all__ = ["ELASTICITY", "ENABLED", "ENABLED_DEFAULT", "ElasticityConfigError", "ElasticityError",
           "ElasticityIncompatibleWorldSize", "compute_elastic_config", "elasticity_enabled",
           "ensure_immutable_elastic_config"]
