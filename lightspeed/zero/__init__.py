"""ZeRO: flat partitioned buffers and the sharding strategies of stages 0-3.

`lightspeed.zero.Init`, `GatheredParameters` and `register_external_parameter` mirror
`deepspeed.zero`'s names, and DeepSpeed's `safe_get_*` / `safe_set_*` parameter accessors
(`deepspeed.utils`) live in `param_access`; they are imported lazily so that `import lightspeed.zero.partition` stays light.
"""

_STAGE3_EXPORTS = ("Init", "GatheredParameters", "register_external_parameter")
_FRAGMENT_EXPORTS = ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                     "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
                     "safe_get_local_grad", "safe_get_local_optimizer_state", "safe_set_full_grad",
                     "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state")

__all__ = list(_STAGE3_EXPORTS)  # deepspeed.zero's names (the accessors are deepspeed.utils')


def __getattr__(name: str):
    if name in _STAGE3_EXPORTS:
        from lightspeed.zero import stage3

        return getattr(stage3, name)
    if name in _FRAGMENT_EXPORTS:
        from lightspeed.zero import param_access as fragments

        return getattr(fragments, name)
    raise AttributeError(f"module 'lightspeed.zero' has no attribute {name!r}")
