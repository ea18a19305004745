"""Stand-ins for DeepSpeed names whose feature lightspeed has not built: each exists (so `hasattr` and
`from deepspeed... import name` behave as with DeepSpeed) and raises NotImplementedError naming the
feature when it is called or constructed. Nothing here returns a value."""

from __future__ import annotations


def missing_function(qualname: str, feature: str):
    """A function `qualname` that raises NotImplementedError: `feature` is not implemented yet."""

    def missing(*args, **kwargs):
        raise NotImplementedError(f"{qualname}: {feature} is not implemented in lightspeed yet")

    missing.__name__ = missing.__qualname__ = qualname.rsplit(".", 1)[-1]
    missing.__doc__ = f"DeepSpeed's `{qualname}`: raises NotImplementedError ({feature} is not built yet)."
    return missing


def missing_class(qualname: str, feature: str) -> type:
    """A class `qualname` whose construction raises NotImplementedError: `feature` is not implemented yet."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{qualname}: {feature} is not implemented in lightspeed yet")

    name = qualname.rsplit(".", 1)[-1]
    return type(name, (), {"__init__": __init__, "__qualname__": name,
                           "__doc__": f"DeepSpeed's `{qualname}`: constructing it raises NotImplementedError "
                                      f"({feature} is not built yet)."})


def optimizer_wrapper_class(qualname: str, when: str) -> type:
    """DeepSpeed's optimizer wrapper class `qualname` (the one it builds for `when`): lightspeed's engine
    steps the client's optimizer through its ZeRO strategy, so the class exists for imports and
    `isinstance(engine.optimizer, ...)` tests (False) and constructing it raises NotImplementedError."""
    return missing_class(qualname, f"constructing DeepSpeed's optimizer wrapper for {when} directly "
                                   "(deepspeed.initialize builds the engine, whose strategy steps the optimizer)")
