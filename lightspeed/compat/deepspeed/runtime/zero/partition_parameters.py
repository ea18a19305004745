"""`deepspeed.runtime.zero.partition_parameters`: where DeepSpeed defines `Init`, `GatheredParameters`
and `register_external_parameter`; lightspeed.zero's objects."""

from lightspeed.zero import GatheredParameters, Init, register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
