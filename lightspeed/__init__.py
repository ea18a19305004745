"""lightspeed: DeepSpeed's training API rebuilt Python-first on PyTorch, torch.distributed and Triton."""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """See :func:`lightspeed.runtime.initialize.initialize` (imported lazily to keep import light); with
    `hybrid_engine.enabled` the engine is a :class:`lightspeed.hybrid.HybridEngine`."""
    from lightspeed.hybrid import initialize as _initialize

    return _initialize(*args, **kwargs)


def init_distributed(*args, **kwargs):
    """See :func:`lightspeed.comm.init.init_distributed`."""
    from lightspeed.comm.init import init_distributed as _init_distributed

    return _init_distributed(*args, **kwargs)


def init_inference(*args, **kwargs):
    """See :func:`lightspeed.inference.init_inference` (imported lazily: no triton/transformers at import)."""
    from lightspeed.inference import init_inference as _init_inference

    return _init_inference(*args, **kwargs)


def tp_model_init(model, tp_size: int, dtype=None, config=None, **kwargs):
    """DeepSpeed's `tp_model_init`: split `model` for tensor-parallel training over `tp_size` ranks; see
    :func:`lightspeed.parallel.autotp.tp_model_init`."""
    from lightspeed.parallel.autotp import tp_model_init as _tp_model_init
    from lightspeed.runtime.model_transforms import zero_init_splitter

    return _tp_model_init(model, tp_size, dtype, config=config, splitter=zero_init_splitter, **kwargs)


def register_as_deepspeed(override: bool = False) -> None:
    """Make `import deepspeed` give lightspeed's DeepSpeed-compatible API (and report a `deepspeed`
    distribution to importlib.metadata); see :mod:`lightspeed.compat.registration`."""
    from lightspeed.compat.registration import register_as_deepspeed as _register

    _register(override=override)


def add_config_arguments(parser):
    """DeepSpeed's --deepspeed / --deepspeed_config flags; see :mod:`lightspeed.config.arguments`."""
    from lightspeed.config.arguments import add_config_arguments as _add

    return _add(parser)


# Subpackages reachable as attributes after a plain `import lightspeed` (`lightspeed.zero.Init()`).
_SUBPACKAGES = ("checkpointing", "comm", "compat", "config", "zero")


def __getattr__(name: str):
    # lazy, so `import lightspeed.ops...` needs neither pydantic nor the config package
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"lightspeed.{name}")
    if name == "OnDevice":
        from lightspeed._utils.init_on_device import OnDevice

        return OnDevice
    if name == "ConfigError":
        from lightspeed.config.errors import ConfigError

        return ConfigError
    raise AttributeError(f"module 'lightspeed' has no attribute {name!r}")


__all__ = ["ConfigError", "OnDevice", "add_config_arguments", "initialize", "init_distributed", "init_inference",
           "register_as_deepspeed", "tp_model_init", "__version__"]
