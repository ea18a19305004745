"""ds_config handling: `load()` validates a DeepSpeed config (dict, JSON/HJSON file or JSON string)
into a `LightspeedConfig` whose attributes carry DeepSpeed's key names, resolves the batch triad, and
reports every problem at once as one `ConfigError`. `check_supported()` raises NotImplementedError
for settings that parse but are not implemented yet.

Modules: `parse.py` (source -> dict), `legacy.py` (renamed keys), `loader.py` (`load`, and `validate`,
which collects the problems instead of raising), `base.py` (the strict section base, value types,
error wording), one module per section family (`batch.py`, `precision.py`, `zero.py`, `optimizer.py`,
`monitoring.py`, `features.py`, `efficiency.py`, `compiler.py`, `tensor_parallel.py`), `model.py`
(`LightspeedConfig` and the cross-section rules), `support.py` (the one list of parsed-but-unimplemented
features), `errors.py`, `arguments.py` (DeepSpeed's `add_config_arguments`)."""

from lightspeed.config.errors import ConfigError
from lightspeed.config.loader import load
from lightspeed.config.model import LightspeedConfig
from lightspeed.config.support import check_supported

__all__ = ["ConfigError", "LightspeedConfig", "check_supported", "load"]
