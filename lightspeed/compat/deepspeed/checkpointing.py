"""`deepspeed.checkpointing`: see `runtime/activation_checkpointing/checkpointing.py`."""

from lightspeed.compat.deepspeed.runtime.activation_checkpointing.checkpointing import *  # noqa: F401,F403
from lightspeed.compat.deepspeed.runtime.activation_checkpointing.checkpointing import __all__  # noqa: F401
