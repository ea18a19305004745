"""ds_config handling: `load()` validates a DeepSpeed config (dict, JSON/HJSON file or JSON string)
into a `LightspeedConfig` whose attributes carry DeepSpeed's key names, resolves the batch triad, and
reports every problem at once as one `ConfigError`. `check_supported()` raises NotImplementedError
for settings that parse but are not implemented yet."""

from lightspeed.config.errors import ConfigError
from lightspeed.config.loader import load
from lightspeed.config.model import LightspeedConfig
from lightspeed.config.support import check_supported

__all__ = ["ConfigError", "LightspeedConfig", "check_supported", "load"]
