"""lightspeed: DeepSpeed's training API rebuilt Python-first on PyTorch, torch.distributed and Triton."""

from lightspeed.config.errors import ConfigError

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """See :func:`lightspeed.runtime.initialize.initialize` (imported lazily to keep import light)."""
    from lightspeed.runtime.initialize import initialize as _initialize

    return _initialize(*args, **kwargs)


def init_distributed(*args, **kwargs):
    """See :func:`lightspeed.comm.init.init_distributed`."""
    from lightspeed.comm.init import init_distributed as _init_distributed

    return _init_distributed(*args, **kwargs)


__all__ = ["ConfigError", "initialize", "init_distributed", "__version__"]
