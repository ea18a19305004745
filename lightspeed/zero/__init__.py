"""ZeRO: flat partitioned buffers and the sharding strategies of stages 0-3.

`lightspeed.zero.Init`, `GatheredParameters` and `register_external_parameter` mirror
`deepspeed.zero`'s names; they are imported lazily so that `import lightspeed.zero.partition` stays light.
"""

_STAGE3_EXPORTS = ("Init", "GatheredParameters", "register_external_parameter")

__all__ = list(_STAGE3_EXPORTS)


def __getattr__(name: str):
    if name in _STAGE3_EXPORTS:
        from lightspeed.zero import stage3

        return getattr(stage3, name)
    raise AttributeError(f"module 'lightspeed.zero' has no attribute {name!r}")
