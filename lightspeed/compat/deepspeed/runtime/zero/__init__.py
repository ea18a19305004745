"""`deepspeed.runtime.zero` (what `deepspeed.zero` is in DeepSpeed): lightspeed.zero's public names."""

from lightspeed.compat.deepspeed.zero import *  # noqa: F401,F403
from lightspeed.compat.deepspeed.zero import __all__, __getattr__  # noqa: F401
